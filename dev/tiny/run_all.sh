#!/usr/bin/env bash
# Train the tiny Laguna, its tokenizer and its DFlash drafter in one run, and pack the results.
#
#   bash dev/tiny/run_all.sh OUTDIR [--smoke]
#
# Stages: corpus.py -> train_tokenizer.py -> train_target.py -> train_drafter.py -> pack. Every stage gets a
# wall-clock budget so the whole run ends within TINY_BUDGET seconds (default 540); the training loops are
# time-based and end early enough to save. If the drafter stage fails the target is packed anyway.
# OUTDIR receives at most 8 files, each < 16 MB:
#   log.txt                         everything printed
#   tiny-target.safetensors.partN   the target's model.safetensors (bf16) split in 15 MB pieces
#   tiny-bundle.tar.gz              tiny/ (target HF dir minus weights), tiny-dflash/ (drafter HF dir),
#                                   tiny-train/ (corpus manifest, held-out set, loss curves, summaries, hparams)
# Rebuild here with: bash dev/tiny/unpack.sh OUTDIR [models/src]
# Environment: TINY_BUDGET (s, default 540), TINY_WORK (scratch dir, default a new /tmp/tiny_work.*),
#              TINY_OVERRIDES (JSON merged into dev/tiny/config.py, e.g. '{"target": {"seconds": 200}}').
set -euo pipefail

if [[ $# -lt 1 ]]; then echo "usage: bash dev/tiny/run_all.sh OUTDIR [--smoke]" >&2; exit 2; fi
OUT=$(realpath -m "$1")
SMOKE=""
if [[ "${2:-}" == "--smoke" ]]; then SMOKE="--smoke"; fi
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${TINY_WORK:-$(mktemp -d /tmp/tiny_work.XXXXXX)}
BUDGET=${TINY_BUDGET:-540}
START=$(date +%s)
DEADLINE=$((START + BUDGET))
PACK_RESERVE=15
DRAFTER_RESERVE=${TINY_DRAFTER_RESERVE:-165}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
PY=${PYTHON:-python3}

left() { echo $((DEADLINE - $(date +%s))); }

# stage NAME HARD_TIMEOUT_S cmd...   (returns the command's status; never exits the script)
stage() {
    local name=$1 limit=$2; shift 2
    if (( limit < 5 )); then echo "== $name: skipped, no time left"; return 1; fi
    echo "== $name (hard limit ${limit} s, $(left) s left of the budget) $(date -u +%H:%M:%S)"
    local t0=$(date +%s) rc=0
    timeout --signal=TERM --kill-after=5 "$limit" "$@" || rc=$?
    echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
    return $rc
}

pack() {
    echo "== pack $(date -u +%H:%M:%S)"
    local st="$WORK/pack"
    rm -rf "$st"; mkdir -p "$st/tiny" "$st/tiny-dflash" "$st/tiny-train"
    rm -f "$OUT"/tiny-target.safetensors.part* "$OUT"/tiny-bundle.tar.gz
    if [[ -f "$WORK/target/model.safetensors" ]]; then
        for f in "$WORK"/target/*; do
            [[ "$(basename "$f")" == model.safetensors ]] || cp "$f" "$st/tiny/"
        done
        (cd "$WORK/target" && sha256sum model.safetensors) > "$st/tiny-train/model.safetensors.sha256"
        split -b 15M -d -a 1 "$WORK/target/model.safetensors" "$OUT/tiny-target.safetensors.part"
    fi
    [[ -f "$WORK/drafter/model.safetensors" ]] && cp "$WORK"/drafter/* "$st/tiny-dflash/"
    for f in corpus/manifest.json heldout.json tok/stats.json; do
        [[ -f "$WORK/$f" ]] && cp "$WORK/$f" "$st/tiny-train/"
    done
    cp "$WORK"/logs/* "$st/tiny-train/" 2>/dev/null || true
    (cd "$HERE" && $PY -c "import config, json, sys; json.dump(config.get(sys.argv[1] == '1'), sys.stdout, indent=1)" \
        "$([[ -n $SMOKE ]] && echo 1 || echo 0)") > "$st/tiny-train/hparams.json" || true
    tar czf "$OUT/tiny-bundle.tar.gz" -C "$st" tiny tiny-dflash tiny-train
    ls -l "$OUT"
    local n big
    n=$(find "$OUT" -type f | wc -l)
    big=$(find "$OUT" -type f -size +16000k | wc -l)
    echo "pack: $n files in $OUT ($big over 16 MB)"
}

summary() {
    $PY - "$WORK" <<'PYEOF' || true
import json, os, sys
w = sys.argv[1]
def j(p):
    try:
        return json.load(open(os.path.join(w, p)))
    except Exception:
        return None
t, d, s = j("logs/target_summary.json"), j("logs/drafter_summary.json"), j("tok/stats.json")
print("== summary")
if s:
    print(f"data: {s['train_tokens']/1e6:.1f}M train tokens ({s['chat_docs']} chat docs), {s['val_tokens']/1e6:.2f}M "
          f"held-out tokens, vocab {s['vocab_size']}, {s['bytes_per_token_train']} bytes/token")
if t:
    print(f"target: {t['parameters']/1e6:.2f}M params, {t['steps']} steps, {t['tokens']/1e6:.1f}M tokens in "
          f"{t['train_seconds']} s ({t['tokens_per_s']/1e3:.0f}K tok/s, experts {t['experts_impl']}), best held-out "
          f"loss {t['best_val_loss']:.4f} (ppl {2.718281828**t['best_val_loss']:.2f}) at step {t['best_step']}")
else:
    print("target: FAILED (see the log)")
if d:
    print(f"drafter: {d['parameters']/1e6:.2f}M params, {d['steps']} steps, {d['blocks']/1e6:.2f}M blocks, "
          f"{d['generated_sequences']} generated sequences; held-out tau of the loop (python) {d['best_val_tau']:.3f}; "
          "per position " + " ".join(f"{x:.2f}" for x in d["best_val_acc_per_position"]))
else:
    print("drafter: FAILED or skipped (see the log)")
PYEOF
}

main() {
    echo "tiny laguna run: out $OUT, work $WORK, budget ${BUDGET} s ${SMOKE:+(smoke)}, $(date -u)"
    $PY -c "import sys, torch, transformers, tokenizers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'tokenizers', tokenizers.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))" || true
    nproc
    local ok=1
    stage corpus $(( $(left) - 300 < 90 ? $(left) - 300 : 90 )) $PY "$HERE/corpus.py" "$WORK" $SMOKE || ok=0
    if (( ok )); then
        stage tokenizer $(( $(left) - 280 < 120 ? $(left) - 280 : 120 )) $PY "$HERE/train_tokenizer.py" "$WORK" $SMOKE || ok=0
    fi
    if (( ok )); then
        local dl=$((DEADLINE - DRAFTER_RESERVE - PACK_RESERVE))
        stage target $(( dl - $(date +%s) + 20 )) $PY "$HERE/train_target.py" "$WORK" $SMOKE --deadline "$dl" || ok=0
    fi
    if (( ok )) && [[ -f "$WORK/target/model.safetensors" ]]; then
        local dl=$((DEADLINE - PACK_RESERVE))
        stage drafter $(( dl - $(date +%s) + 5 )) $PY "$HERE/train_drafter.py" "$WORK" $SMOKE --deadline "$dl" || true
    fi
    pack
    summary
    echo "total $(( $(date +%s) - START )) s"
    [[ -f "$WORK/target/model.safetensors" ]]
}

main 2>&1 | tee "$OUT/log.txt"
