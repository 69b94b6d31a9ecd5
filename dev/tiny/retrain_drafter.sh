#!/usr/bin/env bash
# Retrain only the DFlash drafter of the tiny model, on the target already in models/src/tiny, then export it and
# measure it with the C program.
#
#   bash dev/tiny/retrain_drafter.sh OUTDIR [--smoke-corpus]
#
# Stages, all within TINY_BUDGET seconds (default 450) of the start:
#   corpus.py (deterministic; --smoke-corpus: the 5 MB smoke cap) -> train_drafter.py on WORK/target = a copy of
#   models/src/tiny (TINY_OVERRIDES applies; its deadline leaves TINY_EVAL_RESERVE seconds, default 100, for
#   the rest) -> export.py -> eval.py with the CPU build of ./laguna (made by `make -B laguna` in the
#   background while the drafter trains), DFlash only, --jobs 8 on a 16-core machine; skipped if no time is left.
# OUTDIR receives (at most 5 files, each well under 16 MB):
#   log.txt              everything printed
#   tiny-dflash.tar.gz   tiny-dflash/: the drafter's HF dir (config.json, model.safetensors) + drafter_summary.json,
#                        drafter_loss.csv
#   tiny-dflash.bin      the drafter exported by export.py (copy to models/tiny-dflash.bin)
#   eval.json            python3 dev/tiny/eval.py --model models/tiny.bin --drafter tiny-dflash.bin --no-perplexity
#   make.log             the output of the CPU build
# Environment: TINY_BUDGET, TINY_EVAL_RESERVE, TINY_WORK (scratch dir, default a new /tmp/tiny_redraft.*),
#              TINY_OVERRIDES (JSON merged into dev/tiny/config.py), PYTHON.
set -euo pipefail
if [[ $# -lt 1 ]]; then echo "usage: bash dev/tiny/retrain_drafter.sh OUTDIR [--smoke-corpus]" >&2; exit 2; fi
OUT=$(realpath -m "$1")
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK=${TINY_WORK:-$(mktemp -d /tmp/tiny_redraft.XXXXXX)}
BUDGET=${TINY_BUDGET:-450}
EVAL_RESERVE=${TINY_EVAL_RESERVE:-100}
START=$(date +%s)
DEADLINE=$(( START + BUDGET ))
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
cd "$ROOT"
mkdir -p "$OUT" "$WORK/logs"
exec > >(tee "$OUT/log.txt") 2>&1
echo "drafter retrain: work $WORK, budget $BUDGET s (eval reserve $EVAL_RESERVE s), $(date -u)"
$PY -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" || true
echo "cpus: $(nproc)"

# the CPU build of laguna for the eval, while the GPU trains (-B: a CUDA build left in the tree is not reused)
( make -B laguna > "$OUT/make.log" 2>&1 && echo "make: ok" >> "$OUT/make.log" || echo "make: FAILED" >> "$OUT/make.log" ) &
MAKE_PID=$!

$PY "$HERE/corpus.py" "$WORK" ${2:+--smoke}
rm -rf "$WORK/target"
cp -r "$ROOT/models/src/tiny" "$WORK/target"
cp "$ROOT/models/src/tiny-train/heldout.json" "$WORK/heldout.json"   # its files stay out of the metric set
echo '{"experts_impl": "grouped_mm"}' > "$WORK/logs/target_summary.json"
$PY "$HERE/train_drafter.py" "$WORK" --deadline $(( DEADLINE - EVAL_RESERVE ))

mkdir -p "$WORK/pack/tiny-dflash"
cp "$WORK"/drafter/* "$WORK/pack/tiny-dflash/"
cp "$WORK"/logs/drafter* "$WORK/pack/tiny-dflash/" 2>/dev/null || true
tar czf "$OUT/tiny-dflash.tar.gz" -C "$WORK/pack" tiny-dflash
$PY export.py "$WORK/drafter" "$OUT/tiny-dflash.bin"

wait $MAKE_PID || true
tail -n 3 "$OUT/make.log"
LEFT=$(( DEADLINE - $(date +%s) ))
if [[ -x ./laguna ]] && grep -q "make: ok" "$OUT/make.log" && (( LEFT > 15 )); then
    echo "== eval ($LEFT s left) $(date -u +%H:%M:%S)"
    JOBS=$(( $(nproc) / 2 )); (( JOBS < 1 )) && JOBS=1; (( JOBS > 12 )) && JOBS=12
    timeout --signal=TERM --kill-after=5 "$LEFT" \
        $PY "$HERE/eval.py" --model models/tiny.bin --drafter "$OUT/tiny-dflash.bin" --no-perplexity \
            --jobs "$JOBS" --out "$OUT/eval.json" || echo "eval: exit $? (out of time?)"
else
    echo "eval: skipped ($LEFT s left; see make.log)"
fi
ls -l "$OUT"
echo "total $(( $(date +%s) - START )) s"
