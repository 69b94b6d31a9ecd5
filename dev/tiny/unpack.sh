#!/usr/bin/env bash
# Reassemble the outputs of dev/tiny/run_all.sh (the files the device run left in its OUTDIR).
#
#   bash dev/tiny/unpack.sh FILES_DIR [DEST]          (DEST defaults to models/src)
#
# Creates DEST/tiny/ (the target's Hugging Face dir: config.json, generation_config.json, model.safetensors,
# tokenizer.json, tokenizer_config.json, chat_template.jinja), DEST/tiny-dflash/ (the drafter: config.json,
# model.safetensors) and DEST/tiny-train/ (corpus manifest, held-out set, loss curves, summaries, hparams, log).
# Then:  python3 export.py DEST/tiny models/tiny.bin && python3 export.py DEST/tiny-dflash models/tiny-dflash.bin
set -euo pipefail
if [[ $# -lt 1 ]]; then echo "usage: bash dev/tiny/unpack.sh FILES_DIR [DEST]" >&2; exit 2; fi
SRC=$1
DEST=${2:-models/src}
[[ -f "$SRC/tiny-bundle.tar.gz" ]] || { echo "no tiny-bundle.tar.gz in $SRC" >&2; exit 1; }
mkdir -p "$DEST"
rm -rf "$DEST/tiny" "$DEST/tiny-dflash" "$DEST/tiny-train"
tar xzf "$SRC/tiny-bundle.tar.gz" -C "$DEST"
shopt -s nullglob
parts=("$SRC"/tiny-target.safetensors.part*)
if (( ${#parts[@]} == 0 )); then echo "no tiny-target.safetensors.part* in $SRC" >&2; exit 1; fi
cat $(printf '%s\n' "${parts[@]}" | sort -V) > "$DEST/tiny/model.safetensors"
(cd "$DEST/tiny" && sha256sum -c ../tiny-train/model.safetensors.sha256)
[[ -f "$SRC/log.txt" ]] && cp "$SRC/log.txt" "$DEST/tiny-train/"
if [[ ! -f "$DEST/tiny-dflash/model.safetensors" ]]; then
    echo "warning: the bundle has no drafter (the drafter stage failed; see $DEST/tiny-train/log.txt)" >&2
    rmdir "$DEST/tiny-dflash" 2>/dev/null || true
fi
du -sh "$DEST"/tiny*
