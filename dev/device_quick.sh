#!/bin/bash
# dev/device_quick.sh -- a short device call (~2 min): build, the decode-vs-one-pass GPU tests (they run the one-token
# kernels against the n-token path at 1e-4), and decode tok/s at 512 with LAGUNA_ATTN_CLUSTER=16 / 8 / 0.
# Logs: $OUT/quick.txt
set -u
OUT=${OUT:-/tmp/laguna_quick}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
( python3 export.py -q --synthetic XS-2.1 /dev/shm/xq.tmp && mv /dev/shm/xq.tmp /dev/shm/xq.bin ) > "$OUT/export.log" 2>&1 &
make -j4 cuda dev/bench_gpu > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log" > "$OUT/quick.txt"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" >> "$OUT/quick.txt"
timeout 50 python3 -m pytest -q -s test/test_gpu.py -k "n_token and (xs2_f32 or variant or long)" > "$OUT/test.log" 2>&1
echo "tests rc $?: $(grep '\[gpu\]\|passed\|failed' "$OUT/test.log" | tr '\n' ' ')" >> "$OUT/quick.txt"
wait
for cl in 16 8 0; do
    LAGUNA_ATTN_CLUSTER=$cl timeout 20 ./dev/bench_gpu /dev/shm/xq.bin 512 > "$OUT/bench_$cl.log" 2>&1
    echo "cluster $cl: $(grep '^| 512\|clusters\|rror' "$OUT/bench_$cl.log" | head -3 | tr '\n' ' ')" >> "$OUT/quick.txt"
done
rm -f /dev/shm/xq.bin
echo "done $(( $(date +%s) - t0 )) s" >> "$OUT/quick.txt"
