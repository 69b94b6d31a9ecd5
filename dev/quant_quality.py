#!/usr/bin/env python3
"""Quality of the quantized formats: perplexity, KL divergence and top-1 agreement against the unquantized file.

    python3 dev/quant_quality.py MODEL HELDOUT.json [--files N] [--window 512] [--kv fp8|bf16]
    python3 dev/quant_quality.py --synthetic XS-2.1 --layers 4 [--tokens 1024]   (the mid-size random model)

With --kv fp8 (or bf16: a bf16 model's K/V rounded to bf16, the GPU's default cache) the comparison is the unquantized
file with that KV cache (`laguna --kv ...`) instead of q8 / q4.

Exports MODEL (a checkpoint directory or an exported .bin) as is, q8 and q4 with export.py, scores the held-out token ids (a JSON with
"files": [{"ids": "1 2 3 ..."}], as dev/tiny writes) with `laguna --score --logits`, and compares the logits of
every scored position: KL(reference || quantized), and how often the argmax agrees.

--synthetic: export.py's synthetic file of that shape (--layers of them) in bf16, q8 and q4, all run with
`--random-weights 1` (the q8/q4 files hold export.py's quantization of the same hash values); the scored text is
--tokens tokens sampled from the bf16 model itself (temperature 1, seed 1) after a BOS, since a random model has
no held-out text: its perplexity is the bf16 model's own, and the quantized files' excess over it measures how
far quantization moves the distribution.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def score(laguna, model, ids, tmp, extra=()):
    p = os.path.join(tmp, "ids.txt")
    with open(p, "w") as f:
        f.write(" ".join(map(str, ids)))
    lg = os.path.join(tmp, "logits.bin")
    subprocess.run([laguna, model, "--score", p, "--logits", lg, "-q", *extra], check=True, capture_output=True)
    return np.fromfile(lg, dtype=np.float32).reshape(len(ids), -1)


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", help="checkpoint directory or exported .bin")
    ap.add_argument("heldout", nargs="?")
    ap.add_argument("--synthetic", help="a synthetic shape (export.py --synthetic) with random weights instead")
    ap.add_argument("--layers", type=int, default=4, help="--synthetic: layers")
    ap.add_argument("--tokens", type=int, default=1024, help="--synthetic: tokens sampled and scored")
    ap.add_argument("--files", type=int, default=0, help="score only the first N held-out files (0: all)")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=0, help="stop after scoring about this many tokens (0: all)")
    ap.add_argument("--laguna", default=os.path.join(ROOT, "laguna"))
    ap.add_argument("--kv", choices=["fp8", "bf16"],
                    help="compare an fp8 / bf16 KV cache (on the unquantized file) instead of q8/q4")
    a = ap.parse_args()
    if not a.synthetic and not (a.model and a.heldout):
        ap.error("give MODEL HELDOUT.json, or --synthetic NAME")
    common = ("--random-weights", "1", "-c", str(a.tokens + 8)) if a.synthetic else ()
    if not a.synthetic:
        files = json.load(open(a.heldout))["files"]
        if a.files:
            files = files[:a.files]
    with tempfile.TemporaryDirectory() as tmp:
        models, extra = {}, {}
        for dt in ("auto",) if a.kv else ("auto", "q8", "q4"):
            models[dt] = os.path.join(tmp, f"m_{dt}.bin")
            src = ["--synthetic", a.synthetic, "--layers", str(a.layers)] if a.synthetic else [a.model]
            subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), "-q", *src, models[dt],
                            "--dtype", "bf16" if a.synthetic and dt == "auto" else dt], check=True)
        if a.synthetic:
            out = subprocess.run([a.laguna, models["auto"], "--ids", "2", "-n", str(a.tokens), "-t", "1", "-s", "1",
                                  "-q", *common], check=True, capture_output=True, text=True).stdout.split()
            files = [{"ids": " ".join(out)}]
            a.window = a.tokens
        if a.kv:
            models["kv " + a.kv], extra["kv " + a.kv] = models["auto"], ("--kv", a.kv)
        acc = {dt: dict(nll=0.0, kl=0.0, top1=0, n=0) for dt in models}
        for f in files:
            seq = [2] + [int(x) for x in f["ids"].split()]
            if a.max_tokens and acc["auto"]["n"] >= a.max_tokens:
                break
            for s in range(0, len(seq) - 1, a.window):
                if a.max_tokens and acc["auto"]["n"] >= a.max_tokens:
                    break
                win = seq[s:s + a.window + 1]
                if len(win) < 2:
                    continue
                ref = log_softmax(score(a.laguna, models["auto"], win, tmp, common)[:-1])
                tgt = np.array(win[1:])
                for dt, path in models.items():
                    lp = ref if dt == "auto" else log_softmax(score(a.laguna, path, win, tmp, common + extra.get(dt, ()))[:-1])
                    r = acc[dt]
                    r["nll"] += float(-lp[np.arange(len(tgt)), tgt].sum())
                    r["kl"] += float((np.exp(ref) * (ref - lp)).sum())
                    r["top1"] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
                    r["n"] += len(tgt)
        base = math.exp(acc["auto"]["nll"] / acc["auto"]["n"])
        print(f"{acc['auto']['n']} held-out tokens, {len(files)} files")
        print("| format | file MB | perplexity | vs unquantized | mean KL | top-1 agreement |")
        print("|---|---|---|---|---|---|")
        out = {}
        for dt, r in acc.items():
            ppl = math.exp(r["nll"] / r["n"])
            size = os.path.getsize(models[dt]) / 1e6
            name = "unquantized" if dt == "auto" else dt
            out[name] = dict(perplexity=ppl, rel=ppl / base - 1, kl=r["kl"] / r["n"], top1=r["top1"] / r["n"], mb=size)
            print(f"| {name} | {size:.1f} | {ppl:.4f} | {100 * (ppl / base - 1):+.2f}% | {r['kl'] / r['n']:.5f} | "
                  f"{100 * r['top1'] / r['n']:.2f}% |")
        print("JSON " + json.dumps(out))


if __name__ == "__main__":
    main()
