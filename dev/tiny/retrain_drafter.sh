#!/usr/bin/env bash
# Retrain only the DFlash drafter of the tiny model, on the target already in models/src/tiny.
#
#   bash dev/tiny/retrain_drafter.sh OUTDIR [--smoke-corpus]
#
# The corpus is rebuilt (corpus.py, deterministic) and encoded with the target's own tokenizer.json, so the
# ids are exactly the ones the target was trained on; then train_drafter.py runs (TINY_OVERRIDES applies).
# OUTDIR receives tiny-dflash.tar.gz (the drafter's HF dir + its summary and loss log) and log.txt.
set -euo pipefail
OUT=$(realpath -m "$1")
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
WORK=${TINY_WORK:-$(mktemp -d /tmp/tiny_redraft.XXXXXX)}
BUDGET=${TINY_BUDGET:-240}
DEADLINE=$(( $(date +%s) + BUDGET ))
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
cd "$ROOT"
mkdir -p "$OUT" "$WORK/tok" "$WORK/logs"
exec > >(tee "$OUT/log.txt") 2>&1
echo "drafter retrain: work $WORK, budget $BUDGET s, $(date -u)"
$PY "$HERE/corpus.py" "$WORK" ${2:+--smoke}
$PY - "$WORK" "$ROOT/models/src/tiny/tokenizer.json" <<'PYEOF'
import json, os, sys, time
import numpy as np
sys.path.insert(0, os.path.join("dev", "tiny"))
from tokenizers import Tokenizer
from train_tokenizer import encode_stream
work, tokjson = sys.argv[1], sys.argv[2]
t0 = time.time()
tok = Tokenizer.from_file(tokjson)
train, val = [], []
for line in open(os.path.join(work, "corpus", "docs.jsonl"), encoding="utf-8"):
    d = json.loads(line)
    (val if d["split"] == "val" else train).append(d["text"])
np.save(os.path.join(work, "tok", "train.npy"), encode_stream(tok, train, [True] * len(train)))
np.save(os.path.join(work, "tok", "val.npy"), encode_stream(tok, val, [True] * len(val)))
print(f"encoded {len(train)} + {len(val)} files with the target's tokenizer in {time.time() - t0:.1f} s")
PYEOF
cp -r "$ROOT/models/src/tiny" "$WORK/target"
echo '{"experts_impl": "grouped_mm"}' > "$WORK/logs/target_summary.json"
$PY "$HERE/train_drafter.py" "$WORK" --deadline "$DEADLINE"
mkdir -p "$WORK/pack/tiny-dflash"
cp "$WORK"/drafter/* "$WORK/pack/tiny-dflash/"
cp "$WORK"/logs/drafter* "$WORK/pack/tiny-dflash/" 2>/dev/null || true
tar czf "$OUT/tiny-dflash.tar.gz" -C "$WORK/pack" tiny-dflash
ls -l "$OUT"
