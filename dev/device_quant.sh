#!/usr/bin/env bash
# dev/device_quant.sh -- the GPU side of quantized files (q8 / q4, issue #7) in one device call (< 9 minutes, one H200):
#   0. make cuda, then dev/bench_gpu (the Makefile reuses laguna-cu.o: one compile of laguna.cu)
#   1. the quantized GPU tests (test/test_gpu.py -k quant), with their measured differences
#   2. dev/bench_gpu on synthetic XS-2.1 files in bf16 (the baseline, same build), q8 and q4: file size, decode tok/s
#      at 512 and 8192, prefill, GB/token, GB/s; one file at a time in /dev/shm, deleted after; then the q8 / q4
#      decode speedups over bf16 (the bars: q8 >= 1.7x, q4 >= 2.5x)
#   3. in the time left, the other GPU tests (regressions of the bf16 / f32 paths; not the mid-size model)
# Logs in $OUT (default ./out-quant), 7 files: summary.txt, build.log, test_gpu_quant.log, bench_{bf16,q8,q4}.log,
# test_gpu_rest.log.
#
#   OUT=$OUT bash dev/device_quant.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out-quant}
mkdir -p "$OUT"
BUDGET=${BUDGET:-520}                          # seconds for the whole script (the device call allows 600)
T0=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - T0))); }
say() { echo "[$(date +%T), $(left) s left] $*" | tee -a "$OUT/summary.txt"; }

nvidia-smi -L > "$OUT/summary.txt" 2>&1
say "start ($(git rev-parse --short HEAD 2>/dev/null) + working tree)"

# 0. build
{ make cuda && make dev/bench_gpu; } > "$OUT/build.log" 2>&1
rc=$?
say "build: rc $rc, $(grep -ci 'warning' "$OUT/build.log") warning lines"
if [ $rc -ne 0 ]; then tail -n 30 "$OUT/build.log" >> "$OUT/summary.txt"; exit 1; fi

# 1. the quantized GPU tests (the session fixture's `make cuda` finds everything built)
timeout $(( $(left) - 230 )) python3 -m pytest -q -s -rsx test/test_gpu.py -k quant > "$OUT/test_gpu_quant.log" 2>&1
say "quant tests: rc $? -- $(tail -n 1 "$OUT/test_gpu_quant.log")"
grep '^\[gpu quant\]\|^FAILED\|^XFAIL\|^E  ' "$OUT/test_gpu_quant.log" | cut -c1-240 | head -n 80 >> "$OUT/summary.txt"

# 2. the benchmark: bf16 first (the baseline), then q8 and q4
for dt in bf16 q8 q4; do
    if [ "$(left)" -lt 45 ]; then say "bench $dt skipped: out of time"; continue; fi
    f=/dev/shm/xs21-$dt.bin
    python3 export.py -q --synthetic XS-2.1 "$f" --dtype "$dt" > "$OUT/bench_$dt.log" 2>&1
    ls -ls "$f" >> "$OUT/bench_$dt.log" 2>&1
    lim=$(( $(left) - 10 )); [ $lim -gt 100 ] && lim=100
    timeout $lim ./dev/bench_gpu "$f" 512 8192 >> "$OUT/bench_$dt.log" 2>&1
    rc=$?
    rm -f "$f"
    say "bench $dt: rc $rc"
    grep '^file\|^weights read\|^| [0-9]\|^init\|^gpu:\|rror' "$OUT/bench_$dt.log" | cut -c1-240 >> "$OUT/summary.txt"
done
# decode tok/s (5th column of the table) of q8 and q4 over bf16, per context
python3 - "$OUT" >> "$OUT/summary.txt" 2>&1 <<'PY'
import sys
def dec(dt):
    rows = {}
    try:
        for l in open(f"{sys.argv[1]}/bench_{dt}.log"):
            c = [x.strip() for x in l.split("|")]
            if len(c) > 5 and c[1].isdigit():
                rows[int(c[1])] = float(c[4])
    except OSError:
        pass
    return rows
b = dec("bf16")
for dt, bar in (("q8", 1.7), ("q4", 2.5)):
    q = dec(dt)
    for L in sorted(q):
        if L in b:
            print(f"decode {dt} / bf16 at {L}: {q[L]:.1f} / {b[L]:.1f} tok/s = {q[L] / b[L]:.2f}x (bar {bar}x)")
PY

# 3. the other GPU tests, in the time left
if [ "$(left)" -gt 40 ]; then
    timeout $(( $(left) - 5 )) python3 -m pytest -q -s -rsx test/test_gpu.py -k "not quant and not mid_size" \
        > "$OUT/test_gpu_rest.log" 2>&1
    say "other GPU tests: rc $? -- $(tail -n 1 "$OUT/test_gpu_rest.log")"
    grep '^FAILED\|^XFAIL' "$OUT/test_gpu_rest.log" | cut -c1-240 >> "$OUT/summary.txt"
else
    say "other GPU tests skipped: out of time"
fi
say "done"
