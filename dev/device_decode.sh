#!/bin/bash
# dev/device_decode.sh -- one device call (< 10 min, one H200) for decode-speed work (issues #4, #7):
#   build; dev/bench_gpu on synthetic XS-2.1 (bf16 at 512 and 8K, q8 and q4 at 512); the in-graph cost of each decode
#   step (LAGUNA_DUP=k enqueues the k-th launch of every layer twice: 0 q/k/v/g, 1 attention, 2 o_proj, 3 router,
#   4 gate/up, 5 down -- the step's extra time is that kernel's cost inside the graph); the kernel lab; then
#   `make test-gpu` (TESTS=0 skips it; TESTS_K="expr" runs that pytest -k subset; QUANT="" skips q8/q4; DUPS="3 4"
#   picks the duplicated launches, QDUPS the same for the q8/q4 files; VARIANTS="A=1 B=2,C=3" runs bf16 at 512 once
#   per word with those variables set (commas between several); LAB=0 skips the lab; CHAIN=1 runs dev/chain_lab (the
#   fixed cost of a kernel in a PDL chain, ~1 min) before the benches; BUDGET seconds caps the tests).
# Logs under $OUT: summary.txt (one line per bench run: decode tok/s and ms per token per context), build.log,
# bench_*.log, lab.log, test.log.
set -u
OUT=${OUT:-/tmp/laguna_decode}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
stage() { echo "== $1: $(( $(date +%s) - t0 )) s" | tee -a "$OUT/summary.txt"; }
( for dt in bf16 ${QUANT-q8 q4}; do python3 export.py -q --synthetic XS-2.1 --dtype $dt /dev/shm/xs21-$dt.tmp && \
    mv /dev/shm/xs21-$dt.tmp /dev/shm/xs21-$dt.bin || exit 1; done ) \
    > "$OUT/export.log" 2>&1 &
EXPORT=$!
stage build
{ make cuda && make dev/bench_gpu dev/matvec_lab $([ "${CHAIN:-0}" = 1 ] && echo dev/chain_lab); } > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log" >> "$OUT/summary.txt"; exit 1; }
grep -i "warning" "$OUT/build.log" | head -5 >> "$OUT/summary.txt"
until [ -f /dev/shm/xs21-bf16.bin ] || ! kill -0 $EXPORT 2>/dev/null; do sleep 1; done   # bf16 first
# one bench run: $1 label, $2 file, $3.. contexts (env from the caller): decode tok/s and ms/token per context
b() {
    local label=$1 f=$2; shift 2
    timeout 60 ./dev/bench_gpu "$f" "$@" > "$OUT/bench_$label.log" 2>&1; local rc=$?
    echo "$label: $(grep '^| [0-9]' "$OUT/bench_$label.log" | awk -F'|' '{printf "%s:%s tok/s (%s ms) ", $2, $5, $6}') rc $rc" | tee -a "$OUT/summary.txt"
}
if [ "${CHAIN:-0}" = 1 ]; then
    stage chain
    timeout 120 ./dev/chain_lab > "$OUT/chain.log" 2>&1
    grep "^| \|rror" "$OUT/chain.log" >> "$OUT/summary.txt"
fi
stage bench
b bf16 /dev/shm/xs21-bf16.bin 512 8192
for k in ${DUPS-0 1 2 3 4 5}; do LAGUNA_DUP=$k b dup$k /dev/shm/xs21-bf16.bin 512; done
i=0; for v in ${VARIANTS-}; do i=$((i + 1)); echo "var$i = $v" >> "$OUT/summary.txt"; ( export ${v//,/ }; b var$i /dev/shm/xs21-bf16.bin 512 ); done
wait $EXPORT || cat "$OUT/export.log" >> "$OUT/summary.txt"
for dt in ${QUANT-q8 q4}; do
    b $dt /dev/shm/xs21-$dt.bin 512
    for k in ${QDUPS-}; do LAGUNA_DUP=$k b ${dt}dup$k /dev/shm/xs21-$dt.bin 512; done
done
rm -f /dev/shm/xs21-*.bin /dev/shm/xs21-*.tmp
if [ "${LAB:-1}" = 1 ]; then
    stage lab
    timeout 60 ./dev/matvec_lab > "$OUT/lab.log" 2>&1
    grep "MoE\|round\|check\|rror\|decode_route" "$OUT/lab.log" | head -20 >> "$OUT/summary.txt"
fi
if [ "${TESTS:-1}" = 1 ]; then
    stage tests
    # TESTS_K: a pytest -k expression for a subset (default: all of make test-gpu)
    if [ -n "${TESTS_K:-}" ]; then
        timeout $(( ${BUDGET:-570} - ($(date +%s) - t0) )) python3 -m pytest -q -s -rsx test/test_gpu.py -k "$TESTS_K" > "$OUT/test.log" 2>&1
    else
        timeout $(( ${BUDGET:-570} - ($(date +%s) - t0) )) make test-gpu > "$OUT/test.log" 2>&1
    fi
    echo "tests rc $?" >> "$OUT/test.log"
    grep "\[gpu\|passed\|failed\|error\|XFAIL\|^E  \|rc " "$OUT/test.log" | cut -c1-220 | tail -80 >> "$OUT/summary.txt"
fi
stage done
