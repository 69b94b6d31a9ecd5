#!/usr/bin/env python3
"""Evaluate an exported tiny Laguna (and its DFlash drafter) with the C program, on the held-out set.

    python3 dev/tiny/eval.py --model models/tiny.bin [--drafter models/tiny-dflash.bin]
                             [--heldout models/src/tiny-train/heldout.json] [--laguna ./laguna]
                             [--n 128] [--prompts 24] [--chunk 512] [--jobs J] [--no-perplexity]
                             [--out eval.json] [--plot acceptance.png]

1. Held-out perplexity: every held-out file as [BOS] + ids, cut into windows of --chunk+1 tokens (the training
   length), each scored with `laguna MODEL --score IDS_FILE`; the token-weighted mean NLL and its exp. The ids
   come from heldout.json; `./laguna --tokenize` is checked against them (--no-tokenize-check skips it).
2. DFlash (with --drafter): every held-out prompt through `laguna MODEL -d DRAFT --raw -t 0 -n N` and without the
   drafter; the greedy outputs must be identical; steps / drafted / accepted are summed over prompts: acceptance
   = accepted / drafted, tau = 1 + accepted / steps (incl. the bonus token), and the per-block-position rate.
   --jobs J runs J prompts at a time, each laguna with OMP_NUM_THREADS = cores / J (a tiny model does not keep
   many threads busy); the results do not depend on it.
Prints a summary, writes --out (JSON) and, if matplotlib is importable, --plot. Exit status 1 if a greedy
output differs with the drafter or the C tokenizer disagrees with the stored ids.
"""
import argparse
import concurrent.futures
import json
import math
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DF_RE = re.compile(r"dflash: (\d+) verify steps, (\d+) drafted, (\d+) accepted, acceptance ([\d.]+), "
                   r"mean length tau ([\d.]+)")
POS_RE = re.compile(r"dflash: acceptance per block position:((?: [\d.]+)+)")
SCORE_RE = re.compile(r"tokens (\d+)\s+mean_nll ([-\d.eE+naif]+)\s+perplexity")


def run(cmd, check=True, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(cmd[:6])} ...\n{p.stderr[-2000:]}")
    return p


def tokenize_c(laguna, model, text):
    """Token ids of text with laguna --tokenize, in pieces cut just before a newline run (the pre-tokenizer's
    first split), so the result equals tokenizing the whole text."""
    ids, i = [], 0
    while i < len(text):
        j = min(len(text), i + 20000)
        if j < len(text):
            k = text.rfind("\n", i + 1, j)
            while k > i and text[k - 1] in "\r\n":
                k -= 1
            j = k if k > i else j
        out = run([laguna, model, "--tokenize", text[i:j]]).stdout
        ids.extend(int(x) for x in out.split())
        i = j
    return ids


def perplexity(a, files, tmp):
    nll, n = 0.0, 0
    for f in files:
        seq = [2] + f["ids"]
        for s in range(0, len(seq) - 1, a.chunk):
            win = seq[s:s + a.chunk + 1]
            if len(win) < 2:
                continue
            path = os.path.join(tmp, "ids.txt")
            with open(path, "w") as fo:
                fo.write(" ".join(map(str, win)))
            out = run([a.laguna, a.model, "--score", path, "-q"]).stdout
            m = SCORE_RE.search(out)
            if not m:
                raise SystemExit(f"cannot parse --score output: {out!r}")
            nll += float(m.group(2)) * (int(m.group(1)) - 1)
            n += int(m.group(1)) - 1
    return nll / max(1, n), n


def dflash(a, prompts, tmp):
    tot = {"steps": 0, "drafted": 0, "accepted": 0}
    pos_acc, per_prompt, mismatches = None, [], []
    env = dict(os.environ, OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // a.jobs))) if a.jobs > 1 else None

    def both(i):
        """laguna with and without the drafter on prompt i"""
        path = os.path.join(tmp, f"prompt{i}.txt")
        with open(path, "w", encoding="utf-8") as fo:
            fo.write(prompts[i]["text"])
        base = [a.laguna, a.model, "--raw", "-t", "0", "-n", str(a.n), "-i", path]
        return run(base + ["-d", a.drafter], env=env), run(base, env=env)

    results = [None] * len(prompts)
    with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as ex:
        futures = {ex.submit(both, i): i for i in range(len(prompts))}
        for f in concurrent.futures.as_completed(futures):      # progress, in case the run is cut short
            i = futures[f]
            results[i] = f.result()
            m = DF_RE.search(results[i][0].stderr)
            print(f"  prompt {i}: {'tau ' + m.group(5) if m else 'no dflash line'}", flush=True)
    for i, (p, (with_d, plain)) in enumerate(zip(prompts, results)):
        same = with_d.stdout == plain.stdout
        if not same:
            mismatches.append(i)
        m, mp = DF_RE.search(with_d.stderr), POS_RE.search(with_d.stderr)
        if not m:
            per_prompt.append({"prompt": i, "steps": 0, "same_output": same})
            continue
        steps, drafted, accepted = int(m.group(1)), int(m.group(2)), int(m.group(3))
        rates = [float(x) for x in mp.group(1).split()] if mp else []
        if pos_acc is None:
            pos_acc = [0.0] * len(rates)
        for k, r in enumerate(rates):
            pos_acc[k] += r * steps
        tot["steps"] += steps
        tot["drafted"] += drafted
        tot["accepted"] += accepted
        per_prompt.append({"prompt": i, "file": p.get("file"), "steps": steps, "drafted": drafted,
                           "accepted": accepted, "tau": 1 + accepted / max(1, steps), "same_output": same,
                           "output_head": with_d.stdout[:200]})
    S = max(1, tot["steps"])
    return {"prompts": len(prompts), "n": a.n, **tot, "acceptance": tot["accepted"] / max(1, tot["drafted"]),
            "tau": 1 + tot["accepted"] / S, "per_position": [x / S for x in (pos_acc or [])],
            "tau_mean_of_prompts": sum(x.get("tau", 1.0) for x in per_prompt) / max(1, len(per_prompt)),
            "outputs_identical": not mismatches, "mismatched_prompts": mismatches, "per_prompt": per_prompt}


def plot(res, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not available: no plot")
        return
    d = res["dflash"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = list(range(1, len(d["per_position"]) + 1))
    ax.bar(xs, d["per_position"], color="#4477aa")
    ax.set_xlabel("block position (drafted token)")
    ax.set_ylabel("accepted / verify steps")
    ax.set_title(f"DFlash acceptance per position: tau {d['tau']:.2f}, acceptance {d['acceptance']:.3f}")
    ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--heldout", default=os.path.join(ROOT, "models", "src", "tiny-train", "heldout.json"))
    ap.add_argument("--laguna", default=os.path.join(ROOT, "laguna"))
    ap.add_argument("--n", type=int, default=128, help="tokens to generate per prompt")
    ap.add_argument("--prompts", type=int, default=24, help="at most this many held-out prompts")
    ap.add_argument("--chunk", type=int, default=512, help="scoring window (tokens predicted per --score call)")
    ap.add_argument("--max-files", type=int, default=0, help="score at most this many held-out files (0: all)")
    ap.add_argument("--no-tokenize-check", action="store_true")
    ap.add_argument("--no-perplexity", action="store_true", help="skip the held-out perplexity (DFlash only)")
    ap.add_argument("--jobs", type=int, default=1, help="prompts run at a time (DFlash)")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--plot", help="per-position acceptance PNG (needs matplotlib)")
    a = ap.parse_args()
    with open(a.heldout, encoding="utf-8") as f:
        ho = json.load(f)
    files = ho["files"][:a.max_files] if a.max_files else ho["files"]
    for f in files:
        if isinstance(f["ids"], str):
            f["ids"] = [int(x) for x in f["ids"].split()]
    res = {"model": a.model, "drafter": a.drafter, "heldout_file": a.heldout}
    bad = False
    with tempfile.TemporaryDirectory() as tmp:
        if not a.no_tokenize_check:
            diff = [f["key"] for f in files if tokenize_c(a.laguna, a.model, f["text"]) != f["ids"]]
            res["tokenizer_mismatches"] = diff
            print(f"tokenizer: laguna --tokenize {'matches' if not diff else 'DIFFERS from'} the stored ids "
                  f"on {len(files) - len(diff)}/{len(files)} files")
            bad |= bool(diff)
        if not a.no_perplexity:
            nll, n = perplexity(a, files, tmp)
            res["heldout"] = {"files": len(files), "tokens_scored": n, "mean_nll": nll, "perplexity": math.exp(nll),
                              "chunk": a.chunk}
            print(f"held-out: {len(files)} files, {n} tokens scored: mean NLL {nll:.4f}, perplexity {math.exp(nll):.3f}")
        if a.drafter:
            d = dflash(a, ho["prompts"][:a.prompts], tmp)
            res["dflash"] = d
            print(f"dflash: {d['prompts']} prompts x {a.n} tokens: {d['steps']} verify steps, {d['drafted']} drafted, "
                  f"{d['accepted']} accepted; acceptance {d['acceptance']:.3f}, tau {d['tau']:.2f} "
                  f"(mean over prompts {d['tau_mean_of_prompts']:.2f}); greedy output with = without drafter: "
                  f"{d['outputs_identical']}")
            print("dflash: per position " + " ".join(f"{x:.2f}" for x in d["per_position"]))
            bad |= not d["outputs_identical"]
            if a.plot:
                plot(res, a.plot)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
