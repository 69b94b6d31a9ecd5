#!/bin/bash
# dev/device_next.sh -- one device call (~9 min, one H200) for branch `next`: build; dev/chain_lab; decode at 512
# (and 8K) for bf16 / q8 / q4 with this branch's defaults and with each change switched off (LAGUNA_MV_PREWAIT=0:
# matvec_warp loads its second step after the wait; LAGUNA_DOWN_RW=1: the down projection one row per warp;
# LAGUNA_LMHEAD_RPW=2/4/8: lm_head's rows per warp, twice each); fp8-cache
# prefill and decode at 8K / 32K / 131K (the flash kernel's register-fetched fp8 tiles); then `make test-gpu` with
# what time is left (TESTS=0 skips it: the full suite takes ~6 min, so it may want a call of its own).
# Logs under $OUT: summary.txt (the lines to read), build.log, chain.log, b_*.log, test.log.
set -u
OUT=${OUT:-/tmp/laguna_next}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
t0=$(date +%s)
S="$OUT/summary.txt"
stage() { echo "== $1: $(( $(date +%s) - t0 )) s" >> "$S"; }
( for dt in bf16 q4 q8; do python3 export.py -q --synthetic XS-2.1 --dtype $dt /dev/shm/xn-$dt.tmp && \
    mv /dev/shm/xn-$dt.tmp /dev/shm/xn-$dt.bin || exit 1; done ) > "$OUT/export.log" 2>&1 &
EXP=$!
{ make -j8 cuda dev/bench_gpu dev/chain_lab; } > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log" >> "$S"; exit 1; }
grep -i warning "$OUT/build.log" | head -5 >> "$S"
stage built
timeout 120 ./dev/chain_lab > "$OUT/chain.log" 2>&1
grep "^| \|rror" "$OUT/chain.log" >> "$S"
stage chain
# one bench: $1 label, $2 file, then arguments; env from the caller
b() {
    local label=$1 f=$2; shift 2
    timeout 100 ./dev/bench_gpu "$f" "$@" > "$OUT/b_$label.log" 2>&1; local rc=$?
    echo "$label rc $rc: $(grep '^| [0-9]' "$OUT/b_$label.log" | cut -d'|' -f2-6,11 | tr '\n' ' ')" >> "$S"
}
for dt in bf16 q4 q8; do
    until [ -f /dev/shm/xn-$dt.bin ] || ! kill -0 $EXP 2>/dev/null; do sleep 1; done
    f=/dev/shm/xn-$dt.bin
    b $dt $f 512 8192
    ( export LAGUNA_MV_PREWAIT=0; b ${dt}_noprewait $f 512 )
    if [ $dt = bf16 ]; then      # lm_head rows per warp, each twice (run-to-run noise is ~1%)
        for r in 2 4 8 2 4 8; do ( export LAGUNA_LMHEAD_RPW=$r; b bf16_lm$r $f 512 ); done
    fi
    [ $dt != bf16 ] && ( export LAGUNA_DOWN_RW=1; b ${dt}_rw1 $f 512 )
    [ $dt = bf16 ] && b fp8 $f --kv fp8 8192 32768 131072
    rm -f $f
done
stage benches
[ "${TESTS:-1}" = 0 ] && exit 0
timeout $(( 580 - ($(date +%s) - t0) )) make test-gpu > "$OUT/test.log" 2>&1
echo "tests rc $?" >> "$S"
grep "\[gpu\|passed\|failed\|XFAIL\|^E  " "$OUT/test.log" | cut -c1-200 | tail -70 >> "$S"
stage done
