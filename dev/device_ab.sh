#!/bin/bash
# dev/device_ab.sh -- decode speed of this tree (B) against another commit (A), alternating runs in one device call,
# so machine-to-machine differences (a few %) do not pass for a change's effect.
#   here:   bash dev/device_ab.sh --prepare main      (A's sources into .ab/, which .git/info/exclude must ignore)
#   here:   bash dev/device_ab.sh --prepare-alt .alt1 '-DLAGUNA_X=2' [PATCH]   (optional: this tree built with other
#           flags, '' for none, and/or with a patch applied, e.g. dev/patches/*.patch)
#   device: run(command="OUT=$OUT bash dev/device_ab.sh", carry=[".ab"])
# Builds both, exports the XS-2.1 synthetic file in each of $DTYPES (default bf16 q4 q8), then for each file runs
# dev/bench_gpu at $CTX (default 512) $ROUNDS times (default 3) A, B, A, B, ... and prints each run and the means.
# $VARIANTS: B is run once per word (default, or VAR=value[,VAR=value...] in its environment), e.g.
# VARIANTS="default LAGUNA_X=1"; the label in ab.txt is B or B:word. A word A:VAR=value[,...] runs A with that
# environment instead (label A:VAR=value), e.g. VARIANTS="default LAGUNA_BENCH_TEMP=0.6 A:LAGUNA_BENCH_TEMP=0.6";
# .DIR:VAR=value[,...] runs that ALTS build with it (label DIR:VAR=value).
# Each run's line has the decode tok/s and the 16-token verification's ms per context; a variant with LAGUNA_PROF=1
# adds its first run's verification profile.
# $EXTRA: more B-only bench_gpu command lines (arguments after the file, e.g. "--kv fp8 8192 131072"; several
# separated by ';', each optionally "VAR=x VAR2=y|" first for its environment), on the bf16 file.
# $TRACE=1: B is also built with -DLAGUNA_TRACE and traces one decode step at $TRACE_CTX (default 512) on the bf16 file (trace.csv.gz,
# trace_summary.txt; dev/trace_summary.py's tables (b) and (c) also go to ab.txt); $TRACE_DT: more files to trace the
# same way (e.g. "q8": trace_q8.csv.gz, its tables to ab.txt); $TRACE_ENV (VAR=value words, several
# sets separated by ';'): one more trace per set with that environment (trace_env1.csv.gz, ...; tables to ab.txt), of
# the $TRACE_ENV_DT file (default bf16); in a set, dt=q8 traces that file, ctx=N at that context and bin=.altN that
# ALTS build (built with its trace build when TRACE=1), e.g. TRACE_ENV="LAGUNA_TRACE_MODE=2 bin=.alt1; dt=q8 ctx=3072".
# $LABS: kernel labs (make targets, e.g. "dev/few_lab") built with B and run once after the builds, before the
# benches, their output into ab.txt ($LAB_TIMEOUT s each at most, default 300: dev/few_lab needs more than 120); a word
# LAB:ARG runs it with that argument (dev/few_lab:gemm-sweep).
# $ALTS: more builds to time beside A and B (directories prepared here with --prepare-alt DIR 'NVCC -D flags': this tree's
# sources built with those flags; carry them with .ab), run after A in every round, labelled by their directory.
# $TESTS=1: then the GPU tests (make test-gpu's) on B until $DEADLINE s (default 585) after the start (a call is 600 s at most),
# with $TEST_ENV (VAR=value words) in its environment: the tests' ./laguna runs inherit it; $TEST_K: only the tests
# a pytest -k expression selects. (4 pytest-xdist workers were measured no faster: dev/gpu_notes.md, round 15; a long
# selection goes over several calls, e.g. make test-gpu-1 / test-gpu-2.)
# Logs under $OUT: ab.txt (the lines to read), test.log, runs/ (each run; the build and export logs once the benches
# are done: a failed build or export puts its tail in ab.txt).
set -u
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prepare ]; then
    ref=${2:?usage: dev/device_ab.sh --prepare COMMIT}
    grep -qx '/.ab/' .git/info/exclude || echo '/.ab/' >> .git/info/exclude
    rm -rf .ab && mkdir -p .ab
    git archive "$ref" Makefile laguna.c laguna.cu laguna.h tokenizer.c tokenizer.h tokenizer_unicode.h dev/bench_gpu.c |
        tar -x -C .ab && echo "$(git rev-parse --short "$ref")" > .ab/REF && echo "A = $ref ($(cat .ab/REF)) in .ab/"
    exit
fi
if [ "${1:-}" = --prepare-alt ]; then
    use="usage: dev/device_ab.sh --prepare-alt DIR 'FLAGS' [PATCH]"
    dir=${2:?$use}; flags=${3?$use}; patchf=${4:-}
    grep -qx "/${dir#./}/" .git/info/exclude || echo "/${dir#./}/" >> .git/info/exclude
    rm -rf "$dir" && mkdir -p "$dir/dev"
    cp Makefile laguna.c laguna.cu laguna.h tokenizer.c tokenizer.h tokenizer_unicode.h "$dir"/ && cp dev/bench_gpu.c "$dir/dev/"
    if [ -n "$patchf" ]; then patch -s -p1 -d "$dir" < "$patchf" || { echo "$patchf does not apply" >&2; exit 1; }; fi
    sed -i "s|^NVCCFLAGS ?= \(.*\)|NVCCFLAGS ?= \1 $flags|" "$dir/Makefile"
    echo "this tree${patchf:+ + $patchf}${flags:+ with $flags}" > "$dir/REF" && cat "$dir/REF"
    exit
fi
[ -f .ab/Makefile ] || { echo "no .ab/: run 'bash dev/device_ab.sh --prepare COMMIT' here and carry .ab" >&2; exit 2; }
OUT=${OUT:-/tmp/laguna_ab}
mkdir -p "$OUT/runs"
S="$OUT/ab.txt"
t0=$(date +%s)
DTYPES=${DTYPES:-bf16 q4 q8}
( for dt in $DTYPES; do python3 export.py -q --synthetic XS-2.1 --dtype $dt /dev/shm/ab-$dt.tmp && \
    mv /dev/shm/ab-$dt.tmp /dev/shm/ab-$dt.bin || exit 1; done ) > "$OUT/export.log" 2>&1 &
EXP=$!
( cd .ab && make -j8 cuda dev/bench_gpu > "$OUT/build_a.log" 2>&1 ) &
BA=$!
BALT=                                                   # "pid:dir" of each ALTS build
TR=; [ "${TRACE:-0}" = 1 ] && TR=laguna-cu-trace.o      # its own nvcc run, in parallel; linked below
for d in ${ALTS:-}; do ( cd $d && { make -j8 cuda dev/bench_gpu $TR && { [ -z "$TR" ] || make dev/bench_gpu_trace; }; } \
    > "$OUT/build_${d#.}.log" 2>&1 ) & BALT="$BALT $!:$d"; done    # (with TRACE=1 each alt's trace build too: bin=)
labs=; for lab in ${LABS:-}; do labs="$labs ${lab%%:*}"; done
make -j8 cuda dev/bench_gpu $TR $labs > "$OUT/build_b.log" 2>&1 || { tail -20 "$OUT/build_b.log" >> "$S"; exit 1; }
if [ -n "$TR" ]; then make dev/bench_gpu_trace >> "$OUT/build_b.log" 2>&1 || { tail -20 "$OUT/build_b.log" >> "$S"; exit 1; }; fi
wait $BA || { tail -20 "$OUT/build_a.log" >> "$S"; exit 1; }
for pd in $BALT; do d=${pd#*:}; wait ${pd%%:*} || { tail -20 "$OUT/build_${d#.}.log" >> "$S"; exit 1; }; done
for d in ${ALTS:-}; do echo "${d#.} = $(cat $d/REF)" >> "$S"; done
echo "A = $(cat .ab/REF), B = this tree; built in $(( $(date +%s) - t0 )) s" >> "$S"
wait $EXP || { tail -5 "$OUT/export.log" >> "$S"; exit 1; }   # no export running while timing
echo "exported in $(( $(date +%s) - t0 )) s" >> "$S"
for lab in ${LABS:-}; do echo "== $lab" >> "$S"       # a word LAB:ARG runs ./LAB ARG (e.g. dev/few_lab:gemm-sweep)
    timeout ${LAB_TIMEOUT:-300} ./${lab%%:*} $([[ $lab == *:* ]] && echo "${lab#*:}") >> "$S" 2>&1; echo "== $lab rc $?" >> "$S"; done
CTX=${CTX:-512}
for dt in $DTYPES; do
    f=/dev/shm/ab-$dt.bin
    for r in $(seq ${ROUNDS:-3}); do
        for side in A ${ALTS:-} ${VARIANTS:-default}; do
            bin=./dev/bench_gpu; label=B; envs=; [ $side = A ] && bin=./.ab/dev/bench_gpu && label=A
            case " ${ALTS:-} " in *" $side "*) bin=$side/dev/bench_gpu; label=${side#.}; side=default;; esac
            case $side in
                A | default) ;;
                A:*) bin=./.ab/dev/bench_gpu; label=$side; envs=${side#A:};;   # A with that environment
                .*:*) bin=${side%%:*}/dev/bench_gpu; label=${side#.}; envs=${side#*:};;   # an ALTS build with it
                *) label=B:$side; envs=$side;;
            esac
            log="$OUT/runs/$dt-${label//[:=,]/_}-$r.log"
            ( [ -n "$envs" ] && export ${envs//,/ }
              timeout 60 $bin $f $CTX > "$log" 2>&1 )
            echo "$dt $label $r: $(grep '^| [0-9]' "$log" | cut -d'|' -f2,5 | tr '\n' ' ') $(grep -c rror "$log") errors;" \
                 "verify 16 ms: $(grep '^| [0-9]' "$log" | cut -d'|' -f10 | tr -d ' ' | tr '\n' ' ')" >> "$S"
            [ $r = 1 ] && grep -A24 '^LAGUNA_PROF' "$log" | grep -v '^|' >> "$S"    # a LAGUNA_PROF=1 variant's table
        done
    done
done
# the means of the decode column (tok/s) per dtype, side and context
awk '$3 ~ /^[0-9]+:$/ { for (i = 4; i + 1 <= NF; i += 3) if ($(i + 1) == "|") {
        k = $1 " " $2 " " $i; s[k] += $(i + 2); n[k]++ } }
    END { for (k in s) printf "mean %s: %.1f tok/s (%d runs)\n", k, s[k] / n[k], n[k] }' "$S" | sort >> "$S"
if [ -n "${EXTRA:-}" ] && [ -f /dev/shm/ab-bf16.bin ]; then
    IFS=';' read -ra extras <<< "$EXTRA"
    for ex in "${extras[@]}"; do
        envs=; args=$ex; [[ $ex == *'|'* ]] && envs=${ex%%|*} && args=${ex#*|}   # "VAR=x VAR2=y|args"
        timeout 200 env $envs ./dev/bench_gpu /dev/shm/ab-bf16.bin $args >> "$OUT/extra.log" 2>&1
        echo "B bf16 $ex:" >> "$S"; grep '^| \|rror' "$OUT/extra.log" | tail -n +$(( ${seen:-0} + 1 )) >> "$S"
        seen=$(grep -c '^| \|rror' "$OUT/extra.log")
    done
fi
trace() {   # trace() NAME [VAR=value ...]: one traced step at ${TRACE_CTX:-512}, its tables (b) and (c) appended to ab.txt
    # (three words are not environment: dt=q8 traces that file, ctx=N at that context, bin=.altN that ALTS build's)
    local name=$1 dt=${TDT:-bf16} ctx=${TRACE_CTX:-512} dir=. side=B envs=() w; shift
    for w in "$@"; do case $w in dt=*) dt=${w#dt=};; ctx=*) ctx=${w#ctx=};; bin=*) dir=${w#bin=}; side=${dir#.};;
        *) envs+=("$w");; esac; done
    [ -f /dev/shm/ab-$dt.bin ] || { echo "trace $name: no $dt file (DTYPES)" >> "$S"; return; }
    env "${envs[@]}" LAGUNA_TRACE_OUT="$OUT/$name.csv" timeout 120 $dir/dev/bench_gpu_trace /dev/shm/ab-$dt.bin $ctx \
        > "$OUT/${name}_bench.log" 2>&1
    echo "$side $dt traced build at $ctx $*: $(grep '^| [0-9]' "$OUT/${name}_bench.log" | cut -d'|' -f2,5)" >> "$S"
    python3 dev/trace_summary.py "$OUT/$name.csv" --brief > "$OUT/${name}_summary.txt" 2>&1
    sed -n '/^(b)/,$p' "$OUT/${name}_summary.txt" >> "$S"
    gzip -f "$OUT/$name.csv"
}
if [ -n "$TR" ]; then
    [ -f /dev/shm/ab-bf16.bin ] && trace trace
    if [ -n "${TRACE_ENV:-}" ] && [ -f /dev/shm/ab-${TRACE_ENV_DT:-bf16}.bin ]; then
        IFS=';' read -ra tenvs <<< "$TRACE_ENV"
        for i in "${!tenvs[@]}"; do TDT=${TRACE_ENV_DT:-bf16} trace trace_env$((i + 1)) ${tenvs[$i]}; done
    fi
    for dt in ${TRACE_DT:-}; do [ -f /dev/shm/ab-$dt.bin ] && TDT=$dt trace trace_$dt; done
    rm -f "$OUT"/trace_*_bench.log "$OUT"/trace_*_summary.txt   # the extra traces: their tables are in ab.txt
fi
rm -f /dev/shm/ab-*.bin
echo "benches done in $(( $(date +%s) - t0 )) s" >> "$S"
mv "$OUT"/build_*.log "$OUT/export.log" "$OUT/runs/" 2>/dev/null   # read on failure only (in ab.txt)
[ "${TESTS:-0}" = 1 ] || exit 0
if [ -n "${TEST_K:-}" ]; then set -- -k "$TEST_K"; else set --; fi   # TEST_K: a pytest -k expression
timeout $(( ${DEADLINE:-585} - ($(date +%s) - t0) )) env ${TEST_ENV:-} \
    python3 -m pytest -q -s -rs --durations=15 test/test_gpu.py test/test_gpu_fidelity.py "$@" > "$OUT/test.log" 2>&1
echo "GPU tests rc $? at $(( $(date +%s) - t0 )) s" >> "$S"
grep "\[gpu\|passed\|failed\|XFAIL\|^E  \|s call " "$OUT/test.log" | cut -c1-220 | tail -80 >> "$S"
