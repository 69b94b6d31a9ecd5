#!/bin/bash
# dev/device_sanitize.sh -- the GPU build under compute-sanitizer: every decode, prefill, few-token, DFlash, sampler
# and long-context path the tiny model and a 5-layer synthetic XS-2.1 (the real widths: the full-shape kernels) take,
# run by each of $TOOLS (default memcheck; also racecheck, synccheck, initcheck). A case passes when the tool reports
# nothing (racecheck's warnings count) and laguna exits 0. Only $CASES runs when it is set (glob patterns for the
# case names, e.g. "xs_* tiny_greedy"; the synthetic files are exported only when an xs_* case runs). EXCLUDE is
# passed as --kernel-name-exclude (e.g. EXCLUDE=kns=nvjet leaves cuBLAS's GEMMs out of racecheck, whose hazards inside
# them are cuBLAS's own). Needs a Firecracker device machine (compute-sanitizer refuses gVisor's GPU).
# Logs: $OUT/sanitize.txt (the summary) and $OUT/san_TOOL_CASE.log (the output of each case that did not pass).
# The synthetic files stay in /dev/shm (san-*.bin, sparse) for the next call on the same machine.
#   OUT=$OUT TOOLS="memcheck racecheck" LINEINFO=1 bash dev/device_sanitize.sh
# Measured on an H100, 2026-12-07 (dev/gpu_notes.md, round 42): memcheck 1-3 s a case; synccheck the same but past
# 100 s for the 2,700-token prompts; racecheck ~60 s a tiny-model case.
set -u
OUT=${OUT:-/tmp/laguna_sanitize}
TOOLS=${TOOLS:-memcheck}
CASES=${CASES:-}
LIMIT=${LIMIT:-120}                               # seconds a run (the tools slow kernels down 10-100x)
EXCLUDE=${EXCLUDE:-}
selected() {                                      # selected NAME: is the case in $CASES (or $CASES empty)?
    [ -z "$CASES" ] && return 0
    local w; for w in $CASES; do [[ $1 == $w ]] && return 0; done
    return 1
}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
S="$OUT/sanitize.txt"
t0=$(date +%s)
CS=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
[ -x "$CS" ] || { echo "compute-sanitizer not found" | tee -a "$S"; exit 1; }
"$CS" --version | tail -1 >> "$S"
nvidia-smi --query-gpu=name --format=csv,noheader >> "$S"
# LINEINFO=1: laguna.cu rebuilt with -lineinfo, so the reports name file:line (the same code otherwise; it stays in
# laguna-cu.o until laguna.cu changes or `make -B laguna-cu.o`)
if [ "${LINEINFO:-0}" = 1 ]; then
    make -B laguna-cu.o \
        NVCCFLAGS="-O3 -std=c++17 -arch=sm_${CUDA_ARCH:-90} -lineinfo -Xcompiler -fopenmp,-Wall,-Wextra" \
        > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log" >> "$S"; exit 1; }
fi
make -j16 cuda >> "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log" >> "$S"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" >> "$S"

# the synthetic XS-2.1 files, exported before the first xs_* case: 5 layers (layer 0 full attention + the dense MLP,
# 1-3 sliding + MoE, 4 full + MoE); sparse, filled on the GPU by --random-weights
export_xs() {
    local dt
    for dt in bf16 q8 q4; do
        [ -f /dev/shm/san-$dt.bin ] || python3 export.py -q --synthetic XS-2.1 --layers 5 --dtype $dt \
            /dev/shm/san-$dt.bin >> "$OUT/export.log" 2>&1 \
            || { echo "export $dt failed" >> "$S"; tail -5 "$OUT/export.log" >> "$S"; exit 1; }
    done
}
ids() {                                           # N ids in 3 .. MAX-1 from seed S: ids N S MAX
    python3 -c "import random; r = random.Random($2); print(' '.join(str(r.randrange(3, $3)) for _ in range($1)))"
}
P40=$(ids 40 1 100000)                            # a 40-token prompt (XS vocabulary)
P2700=$(ids 2700 2 100000)                        # past long_from (2560): the long-context flash kernel and merge
ids 300 3 8000 > "$OUT/tiny_ids.txt"              # tiny vocabulary (8192)
XS=(--random-weights 1 -t 0)

# name | command (after ./laguna)
CASE_LIST=(
"tiny_greedy|models/tiny.bin -n 24 -t 0 -c 256 def fib(n):"
"tiny_sample|models/tiny.bin -n 24 -t 0.8 -p 0.9 -s 7 -c 256 def fib(n):"
"tiny_dflash|models/tiny.bin -d models/tiny-dflash.bin -n 40 -t 0 -c 256 def fib(n):"
"tiny_dflash_t07|models/tiny.bin -d models/tiny-dflash.bin -n 40 -t 0.7 -s 3 -c 256 def fib(n):"
"tiny_kv_fp8|models/tiny.bin --kv fp8 -n 24 -t 0 -c 256 def fib(n):"
"tiny_kv_f32|models/tiny.bin --kv f32 -n 24 -t 0 -c 256 def fib(n):"
"tiny_score|models/tiny.bin --score $OUT/tiny_ids.txt --logits /dev/shm/san_logits.bin"
"xs_bf16|/dev/shm/san-bf16.bin ${XS[*]} -c 1024 -n 8 --ids $P40"
"xs_bf16_chunk16|/dev/shm/san-bf16.bin ${XS[*]} -c 1024 -n 4 --chunk 16 --ids $P40"
"xs_bf16_chunk5|/dev/shm/san-bf16.bin ${XS[*]} -c 1024 -n 4 --chunk 5 --ids $P40"
"xs_bf16_chunk2|/dev/shm/san-bf16.bin ${XS[*]} -c 1024 -n 4 --chunk 2 --ids $P40"
"xs_bf16_sample|/dev/shm/san-bf16.bin --random-weights 1 -t 0.7 -p 0.9 -s 5 -c 1024 -n 8 --ids $P40"
"xs_bf16_fp8|/dev/shm/san-bf16.bin ${XS[*]} --kv fp8 -c 1024 -n 8 --chunk 16 --ids $P40"
"xs_bf16_f32|/dev/shm/san-bf16.bin ${XS[*]} --kv f32 -c 1024 -n 8 --ids $P40"
"xs_q8|/dev/shm/san-q8.bin ${XS[*]} -c 1024 -n 8 --ids $P40"
"xs_q8_chunk16|/dev/shm/san-q8.bin ${XS[*]} -c 1024 -n 4 --chunk 16 --ids $P40"
"xs_q8_chunk5|/dev/shm/san-q8.bin ${XS[*]} -c 1024 -n 4 --chunk 5 --ids $P40"
"xs_q4|/dev/shm/san-q4.bin ${XS[*]} -c 1024 -n 8 --ids $P40"
"xs_q4_chunk16|/dev/shm/san-q4.bin ${XS[*]} -c 1024 -n 4 --chunk 16 --ids $P40"
"xs_q4_chunk5|/dev/shm/san-q4.bin ${XS[*]} -c 1024 -n 4 --chunk 5 --ids $P40"
"xs_bf16_long|/dev/shm/san-bf16.bin ${XS[*]} -c 4096 -n 4 --ids $P2700"
"xs_bf16_long_fp8|/dev/shm/san-bf16.bin ${XS[*]} --kv fp8 -c 4096 -n 4 --ids $P2700"
"xs_q8_long|/dev/shm/san-q8.bin ${XS[*]} -c 4096 -n 4 --ids $P2700"
)

for tool in $TOOLS; do
    opts=(--tool "$tool" --error-exitcode 9 --print-limit 200)
    [ "$tool" = memcheck ] && opts+=(--leak-check full)
    [ -n "$EXCLUDE" ] && opts+=(--kernel-name-exclude "$EXCLUDE")
    for entry in "${CASE_LIST[@]}"; do
        name=${entry%%|*}; cmd=${entry#*|}
        selected "$name" || continue
        [[ $name == xs_* ]] && export_xs
        log="$OUT/san_${tool}_$name.log"
        t1=$(date +%s)
        # the last argument of the tiny cases is the prompt: split at " def" so it stays one word
        if [[ $name == tiny_* && $cmd == *" def"* ]]; then
            timeout $LIMIT "$CS" "${opts[@]}" ./laguna ${cmd%% def*} "def${cmd#* def}" > "$log" 2>&1
        elif [[ $cmd == *"--ids "* ]]; then
            timeout $LIMIT "$CS" "${opts[@]}" ./laguna ${cmd%%--ids *} --ids "${cmd#*--ids }" > "$log" 2>&1
        else
            timeout $LIMIT "$CS" "${opts[@]}" ./laguna $cmd > "$log" 2>&1
        fi
        rc=$?
        sum=$(grep -m1 -E "(ERROR|RACECHECK) SUMMARY" "$log" || echo "no summary")
        printf '%-10s %-18s rc %3d %4d s  %s\n' "$tool" "$name" $rc $(( $(date +%s) - t1 )) "$sum" >> "$S"
        grep -m2 -E "^laguna: |^(prompt|scored|accept)" "$log" | cut -c1-150 | sed 's/^/    /' >> "$S"
        [ $rc = 0 ] && { rm -f "$log"; continue; }
        # the first reports, kernel signatures shortened (a -lineinfo build names file:line)
        grep -E "Invalid|Race reported|and (Read|Write) access|Barrier|Uninitiali|Leaked|Program hit|^laguna: " "$log" \
            | sed -E 's/\((const |int|float|T1|__nv)[^)]*\)//g' | sort | uniq -c | sort -rn | head -12 | cut -c1-240 \
            | sed 's/^/    /' >> "$S"
    done
done
echo "done $(( $(date +%s) - t0 )) s" >> "$S"
