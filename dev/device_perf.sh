#!/bin/bash
# dev/device_perf.sh -- one device call for the decode-speed work (issue #4): build, correctness, benchmark,
# kernel lab and a per-kernel ncu profile of one decode step, logs under $OUT (the device tool's folder).
#   bash dev/device_perf.sh            (~6 minutes on one H200; each stage has its own time limit)
# Stages write: build.log, test.log, bench.log, lab.log, ncu.csv, ncu_step.txt, ncu_step_old_attn.txt (and summary.txt: the tail of each).
set -u
OUT=${OUT:-/tmp/laguna_perf}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/build.log" 2>&1
t0=$(date +%s)
stage() { echo "== $1: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"; }

# the synthetic files (weights left as holes, filled on the device), exported while the build and tests run
( python3 export.py -q --synthetic XS-2.1 /dev/shm/xs21.bin && python3 export.py -q --synthetic XS-2.1 --layers 4 /dev/shm/x4.bin ) \
    > "$OUT/export.log" 2>&1 &
EXPORT=$!

stage build
make cuda >> "$OUT/build.log" 2>&1 || { echo "make cuda failed"; tail -30 "$OUT/build.log"; exit 1; }
make dev/matvec_lab >> "$OUT/build.log" 2>&1 &      # its own nvcc run: in parallel with the benchmark's
LAB=$!
make dev/bench_gpu >> "$OUT/build.log" 2>&1 || { echo "make dev/bench_gpu failed"; tail -30 "$OUT/build.log"; exit 1; }
wait $LAB || echo "make dev/matvec_lab failed" >> "$OUT/summary.txt"
grep -i "warning\|error" "$OUT/build.log" | head -5 >> "$OUT/summary.txt"

stage tests
# correctness: fixtures vs transformers and the CPU, greedy, --chunk 1/7, f32-KV exact path, graph == plain == no PDL
timeout 150 python3 -m pytest -q -s -rs test/test_gpu.py -k "not mid_size and not sampling and not longer" > "$OUT/test.log" 2>&1
echo "pytest rc $?" >> "$OUT/test.log"
grep "\[gpu\]\|passed\|failed\|error\|xfail" "$OUT/test.log" | tail -40 >> "$OUT/summary.txt"

wait $EXPORT
cat "$OUT/export.log" >> "$OUT/build.log" && rm -f "$OUT/export.log"
stage bench
# decode at 512 and 8K with programmatic dependent launch, then 512 without it (same kernels otherwise)
timeout 100 ./dev/bench_gpu /dev/shm/xs21.bin 512 8192 32768 > "$OUT/bench.log" 2>&1
# the same kernels without programmatic dependent launch (the A/B switch kept for later rounds)
echo "--- LAGUNA_NO_PDL=1" >> "$OUT/bench.log"
LAGUNA_NO_PDL=1 timeout 45 ./dev/bench_gpu /dev/shm/xs21.bin 512 >> "$OUT/bench.log" 2>&1
grep "^|\|^---\|init\|error" "$OUT/bench.log" | grep -v "^|---\|^| context" >> "$OUT/summary.txt"

stage lab
timeout 45 ./dev/matvec_lab > "$OUT/lab.log" 2>&1
grep "^|\|check\|copy\|rror" "$OUT/lab.log" >> "$OUT/summary.txt"

stage ncu
# one decode step of the 4-layer file after a 512-token prompt, every kernel timed on its own (caches flushed)
IDS=$(python3 -c "print(' '.join(str(3 + (i * 7919) % 100000) for i in range(512)))")
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum,dram__bytes_read.sum --csv \
    ./laguna /dev/shm/x4.bin --random-weights 1 --ids -t 0 -n 3 "$IDS" > "$OUT/ncu.csv" 2>&1
python3 dev/ncu_summary.py "$OUT/ncu.csv" > "$OUT/ncu_step.txt" 2>&1
cat "$OUT/ncu_step.txt" >> "$OUT/summary.txt"
stage done
rm -f /dev/shm/xs21.bin /dev/shm/x4.bin
cat "$OUT/summary.txt"
