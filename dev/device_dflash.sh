#!/usr/bin/env bash
# dev/device_dflash.sh -- the GPU DFlash checks in one device run (about 6 minutes on one H200): the build, the GPU
# DFlash tests, the full-shape benchmark (dev/bench_dflash.c), the whole loop on the synthetic XS-2.1 pair, and the
# other GPU tests (the attention kernels and forward_gpu gained hooks).
#
#   bash dev/device_dflash.sh      logs into $OUT (default ./device-out): summary.txt (read this first), build.log,
#                                  tests.log, bench.log, e2e.log, regress.log
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
S="$OUT/summary.txt"
: > "$S"
T0=$SECONDS
step() { echo "== $* ($(date +%T), $((SECONDS - T0)) s in)" | tee -a "$S"; }
left() { echo $((570 - (SECONDS - T0))); }       # seconds to the end of a 10-minute device call, with a margin

step "build (make cuda, make dev/bench_dflash)"
{ nvidia-smi -L; nvcc --version | tail -2; python3 -c "import numpy, pytest; print('numpy', numpy.__version__, 'pytest', pytest.__version__)"; } \
    > "$OUT/build.log" 2>&1
make clean > /dev/null     # no stale laguna-cu.o kept from an earlier call
if ! { make cuda && make dev/bench_dflash; } >> "$OUT/build.log" 2>&1; then
    echo "build FAILED (build.log):" | tee -a "$S"; tail -40 "$OUT/build.log" | tee -a "$S"; exit 1
fi
head -4 "$OUT/build.log" >> "$S"
grep -iE "warning|error" "$OUT/build.log" | tee -a "$S"     # expected: nothing

step "GPU DFlash tests: pytest -k dflash test/test_gpu.py"
timeout 270 python3 -m pytest -q -s -rs -rx -k dflash test/test_gpu.py > "$OUT/tests.log" 2>&1
echo "pytest exit $?" | tee -a "$S"
grep -E "^\[gpu dflash\]|passed|failed|xfail|XFAIL|FAILED|Error|error:" "$OUT/tests.log" | head -80 | tee -a "$S"

step "synthetic XS-2.1 and XS-2.1-DFlash (sparse files; --random-weights fills them on the GPU)"
if ! { python3 export.py -q --synthetic XS-2.1 /dev/shm/xs21.bin &&
       python3 export.py -q --synthetic XS-2.1-DFlash /dev/shm/xs21-dflash.bin; } >> "$S" 2>&1; then
    echo "export FAILED" | tee -a "$S"; exit 1
fi

step "benchmark: ./dev/bench_dflash /dev/shm/xs21.bin /dev/shm/xs21-dflash.bin"
timeout 150 ./dev/bench_dflash /dev/shm/xs21.bin /dev/shm/xs21-dflash.bin 512 2048 8192 32768 > "$OUT/bench.log" 2>&1
echo "bench exit $?" | tee -a "$S"
cat "$OUT/bench.log" | tee -a "$S"

step "the whole loop (-d) on the synthetic pair: 600-id prompt, greedy with --compare, then T 0.7"
PROMPT=$(seq 1000 1599 | tr '\n' ' ')
E2E=(./laguna /dev/shm/xs21.bin -d /dev/shm/xs21-dflash.bin --random-weights 1 -c 8192 --ids "$PROMPT")
timeout 90 "${E2E[@]}" -t 0 -n 128 --compare > "$OUT/e2e.log" 2>&1
echo "greedy run exit $?" | tee -a "$S"
timeout 60 "${E2E[@]}" -t 0.7 -s 1 -n 48 >> "$OUT/e2e.log" 2>&1
echo "sampled run exit $?" | tee -a "$S"
grep -vE "^[0-9 ]+$" "$OUT/e2e.log" | tee -a "$S"

step "the other GPU tests (regressions; the mid-size CPU reference skipped for time)"
if [ "$(left)" -lt 60 ]; then echo "skipped: out of time" | tee -a "$S"; exit 0; fi
timeout "$(left)" python3 -m pytest -q -s -rs -rx -k "not dflash and not mid_size" test/test_gpu.py > "$OUT/regress.log" 2>&1
echo "pytest exit $?" | tee -a "$S"
grep -E "^\[gpu\]|passed|failed|xfail|FAILED" "$OUT/regress.log" | tee -a "$S"
step done
