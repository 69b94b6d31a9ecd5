#!/bin/bash
# dev/device_quick.sh -- a short device call (~3 min) for a branch's change to the one-token kernels: build, the GPU
# tests that hold the one-token kernels to the n-token path and the CPU at 1e-4 (f32 fixtures, q8/q4), then decode
# tok/s at 512 for bf16, q8 and q4 with the branch's default and with each of $VARIANTS (words of VAR=value,
# commas between several; default: LAGUNA_NO_PDL=1, the chain without programmatic dependent launch).
# Logs: $OUT/quick.txt
set -u
OUT=${OUT:-/tmp/laguna_quick}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
Q="$OUT/quick.txt"
( for dt in bf16 q8 q4; do python3 export.py -q --synthetic XS-2.1 --dtype $dt /dev/shm/xq-$dt.tmp && \
    mv /dev/shm/xq-$dt.tmp /dev/shm/xq-$dt.bin || exit 1; done ) > "$OUT/export.log" 2>&1 &
EXP=$!
make -j4 cuda dev/bench_gpu > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log" > "$Q"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" >> "$Q"
timeout 150 python3 -m pytest -q -s test/test_gpu.py \
    -k "(n_token and (xs2_f32 or variant or long)) or quant_logits_match or quant_greedy or graph_equals" \
    > "$OUT/test.log" 2>&1
echo "tests rc $?: $(grep 'passed\|failed' "$OUT/test.log" | tail -1)" >> "$Q"
grep "^\[gpu\|^E  " "$OUT/test.log" | cut -c1-160 >> "$Q"
for dt in bf16 q8 q4; do
    until [ -f /dev/shm/xq-$dt.bin ] || ! kill -0 $EXP 2>/dev/null; do sleep 1; done
    for v in default ${VARIANTS-LAGUNA_NO_PDL=1}; do
        ( [ "$v" != default ] && export ${v//,/ }
          timeout 30 ./dev/bench_gpu /dev/shm/xq-$dt.bin 512 > "$OUT/bench.log" 2>&1
          echo "$dt $v: $(grep '^| 512' "$OUT/bench.log" | cut -d'|' -f5,6) $(grep -c rror "$OUT/bench.log") errors" >> "$Q" )
    done
    rm -f /dev/shm/xq-$dt.bin
done
echo "done $(( $(date +%s) - t0 )) s" >> "$Q"
