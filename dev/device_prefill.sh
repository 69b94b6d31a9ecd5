#!/usr/bin/env bash
# dev/device_prefill.sh -- one device call for the n > 1 (prefill / verification) work of issue #4:
#   build (laguna, dev/bench_gpu, dev/moe_gemm_lab), the kernel lab (grouped expert GEMM, routing, flash attention
#   vs references; timings), the GPU correctness tests (test/test_gpu.py without the slow mid-size CPU run), and the
#   prefill benchmark at 512 (warm-up), 8K, 32K and 131,072 tokens on the synthetic XS-2.1 file.
#   bash dev/device_prefill.sh        (logs under $OUT, or ./out; about 5 minutes on an H200)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
status=0

stamp "build (sm_90) and the synthetic XS-2.1 file (sparse; filled on the GPU)"
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > "$OUT/build.log" 2>&1
python3 export.py -q --synthetic XS-2.1 /dev/shm/xs21.bin > "$OUT/export.log" 2>&1 &
exp_pid=$!
make dev/moe_gemm_lab > "$OUT/build_lab.log" 2>&1 &
lab_pid=$!
if ! { make cuda && make dev/bench_gpu; } >> "$OUT/build.log" 2>&1; then tail -40 "$OUT/build.log"; exit 1; fi
wait $lab_pid || { tail -40 "$OUT/build_lab.log"; status=1; }
cat "$OUT/build_lab.log" >> "$OUT/build.log"; rm -f "$OUT/build_lab.log"

stamp "kernel lab"
if [ -x dev/moe_gemm_lab ]; then
    timeout 90 ./dev/moe_gemm_lab > "$OUT/lab.log" 2>&1 || status=1
    cat "$OUT/lab.log"
fi

stamp "correctness: test/test_gpu.py -k 'not mid_size'"
timeout 120 python3 -m pytest -q -x -s -rs test/test_gpu.py -k "not mid_size" > "$OUT/pytest.log" 2>&1 || status=1
grep -E "^\[gpu\]|passed|failed|xfail|error" "$OUT/pytest.log" | tail -40

stamp "prefill benchmark"
wait $exp_pid || { cat "$OUT/export.log"; exit 1; }
timeout 150 ./dev/bench_gpu /dev/shm/xs21.bin 512 8192 32768 131072 > "$OUT/bench.log" 2>&1 || status=1
cat "$OUT/bench.log"
rm -f /dev/shm/xs21.bin
stamp "done (status $status)"
exit $status
