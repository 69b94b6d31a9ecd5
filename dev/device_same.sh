#!/bin/bash
# dev/device_same.sh -- are this tree's (B) logits A's bit for bit? For changes that move loads, launches or the
# order of independent work but no arithmetic. Run after dev/device_ab.sh in the same call (it uses both builds:
# ./laguna and .ab/laguna): the mid-size random model (XS-2.1 widths, 4 layers, --random-weights 1) scores $N random
# ids (default 1200) one token at a time (the decode kernels) and in chunks of 16 (the verify's), once per
# environment word of $ENVS (default "LAGUNA_LONG_FROM=0 -": full layers by the long-context kernel from position 0,
# then the defaults; VAR=value[,VAR=value...], or - for none), and compares the two logits files with cmp.
# Lines into $OUT/same.txt (and stdout): "same" or "DIFFER" per case, and a last line "N passed, N failed".
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/laguna_same}
mkdir -p "$OUT"
S="$OUT/same.txt"
[ -x .ab/laguna ] && [ -x ./laguna ] || { echo "no ./laguna or .ab/laguna: build both first (dev/device_ab.sh)" | tee -a "$S"; exit 2; }
python3 export.py -q --synthetic XS-2.1 --layers 4 /dev/shm/same-mid.bin || exit 1
python3 -c "import numpy as np; print(' '.join(map(str, np.random.default_rng(1).integers(3, 100352, ${N:-1200}))))" \
    > /dev/shm/same-ids.txt
pass=0; fail=0
for e in ${ENVS:-LAGUNA_LONG_FROM=0 -}; do
    for ch in 1 16; do
        for side in a b; do
            bin=./laguna; [ $side = a ] && bin=.ab/laguna
            ( [ "$e" != - ] && export ${e//,/ }
              timeout 120 $bin /dev/shm/same-mid.bin --random-weights 1 -c 4096 --chunk $ch -q \
                  --score /dev/shm/same-ids.txt --logits /dev/shm/same-$side.bin > /dev/null 2> "$OUT/same-$side.err" ) ||
                { echo "$side failed: $(tail -3 "$OUT/same-$side.err")" | tee -a "$S"; }
        done
        if [ -s /dev/shm/same-a.bin ] && cmp -s /dev/shm/same-a.bin /dev/shm/same-b.bin; then
            echo "same: $e, chunk $ch ($(stat -c %s /dev/shm/same-b.bin) bytes of logits)" | tee -a "$S"; pass=$((pass + 1))
        else
            echo "DIFFER: $e, chunk $ch ($(cmp /dev/shm/same-a.bin /dev/shm/same-b.bin 2>&1 | head -1))" | tee -a "$S"
            fail=$((fail + 1))
        fi
        rm -f /dev/shm/same-a.bin /dev/shm/same-b.bin
    done
done
rm -f /dev/shm/same-mid.bin /dev/shm/same-ids.txt
echo "same logits: $pass passed, $fail failed" | tee -a "$S"
