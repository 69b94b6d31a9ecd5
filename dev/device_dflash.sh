#!/usr/bin/env bash
# dev/device_dflash.sh -- the GPU DFlash checks in one device run (about 6 minutes on one H200): the build, the GPU
# DFlash tests, the full-shape benchmark (dev/bench_dflash.c), the whole loop on the synthetic XS-2.1 pair, and the
# other GPU tests (the attention kernels and forward_gpu gained hooks).
#
#   bash dev/device_dflash.sh      logs into $OUT (default ./device-out): summary.txt (read this first), build.log,
#                                  tests.log, bench*.log, e2e.log, regress.log
# Switches (environment): TEST_K, the tests' -k (default dflash; "" skips them); DTYPES, the target files benchmarked
# (default bf16; q8 / q4 are each run beside the bf16 drafter and beside the drafter quantized alike); CTX, the
# benchmark's contexts (default 512 2048 8192 32768); E2E=0 and REGRESS=0 skip those steps; BUILD=0 reuses the last
# call's build.
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
# BUILD=0: keep the binaries an earlier call of this session built (the device keeps ignored build outputs)
if [ "${BUILD:-1}" = 0 ] && [ -x laguna ] && [ -x dev/bench_dflash ]; then
    echo "(BUILD=0: the last call's binaries)" >> "$OUT/build.log"
elif ! { make clean > /dev/null && make cuda && make dev/bench_dflash; } >> "$OUT/build.log" 2>&1; then
    echo "build FAILED (build.log):" | tee -a "$S"; tail -40 "$OUT/build.log" | tee -a "$S"; exit 1
fi
head -4 "$OUT/build.log" >> "$S"
grep -iE "warning|error" "$OUT/build.log" | tee -a "$S"     # expected: nothing

TEST_K=${TEST_K-dflash}
if [ -n "$TEST_K" ]; then
    step "GPU tests: pytest -k \"$TEST_K\" test/test_gpu.py"
    timeout 330 python3 -m pytest -q -s -rs -rx -k "$TEST_K" test/test_gpu.py > "$OUT/tests.log" 2>&1
    echo "pytest exit $?" | tee -a "$S"
    grep -E "^\[gpu|passed|failed|xfail|XFAIL|FAILED|Error|error:" "$OUT/tests.log" | head -120 | tee -a "$S"
fi

step "synthetic XS-2.1 and XS-2.1-DFlash (sparse files; --random-weights fills them on the GPU)"
if ! { python3 export.py -q --synthetic XS-2.1 /dev/shm/xs21.bin &&
       python3 export.py -q --synthetic XS-2.1-DFlash /dev/shm/xs21-dflash.bin; } >> "$S" 2>&1; then
    echo "export FAILED" | tee -a "$S"; exit 1
fi

CTX=${CTX:-512 2048 8192 32768}
for dt in ${DTYPES-bf16}; do
    tgt=/dev/shm/xs21.bin; drafters=/dev/shm/xs21-dflash.bin
    if [ "$dt" != bf16 ]; then
        tgt=/dev/shm/xs21-$dt.bin; drafters="/dev/shm/xs21-dflash.bin /dev/shm/xs21-dflash-$dt.bin"
        python3 export.py -q --synthetic XS-2.1 --dtype "$dt" "$tgt" >> "$S" 2>&1 &&
            python3 export.py -q --synthetic XS-2.1-DFlash --dtype "$dt" "/dev/shm/xs21-dflash-$dt.bin" >> "$S" 2>&1 ||
            { echo "export FAILED ($dt)" | tee -a "$S"; continue; }
    fi
    for drf in $drafters; do
        step "benchmark: ./dev/bench_dflash $tgt $drf $CTX"
        log="$OUT/bench_$(basename "$tgt" .bin)_$(basename "$drf" .bin).log"
        timeout 150 ./dev/bench_dflash "$tgt" "$drf" $CTX > "$log" 2>&1
        echo "bench exit $?" | tee -a "$S"
        tee -a "$S" < "$log"
    done
    [ "$dt" != bf16 ] && rm -f "$tgt"          # /dev/shm holds one quantized target at a time
done

if [ "${E2E:-1}" = 1 ]; then
step "the whole loop (-d) on the synthetic pair: 600-id prompt, greedy with --compare, then T 0.7"
PROMPT=$(seq 1000 1599 | tr '\n' ' ')
E2E=(./laguna /dev/shm/xs21.bin -d /dev/shm/xs21-dflash.bin --random-weights 1 -c 8192 --ids "$PROMPT")
timeout 90 "${E2E[@]}" -t 0 -n 128 --compare > "$OUT/e2e.log" 2>&1
echo "greedy run exit $?" | tee -a "$S"
timeout 60 "${E2E[@]}" -t 0.7 -s 1 -n 48 >> "$OUT/e2e.log" 2>&1
echo "sampled run exit $?" | tee -a "$S"
grep -vE "^[0-9 ]+$" "$OUT/e2e.log" | tee -a "$S"
fi
[ "${REGRESS:-1}" = 1 ] || { step done; exit 0; }

step "the other GPU tests (regressions; the mid-size CPU reference skipped for time)"
if [ "$(left)" -lt 60 ]; then echo "skipped: out of time" | tee -a "$S"; exit 0; fi
timeout "$(left)" python3 -m pytest -q -s -rs -rx -k "not dflash and not mid_size" test/test_gpu.py > "$OUT/regress.log" 2>&1
echo "pytest exit $?" | tee -a "$S"
grep -E "^\[gpu\]|passed|failed|xfail|FAILED" "$OUT/regress.log" | tee -a "$S"
step done
