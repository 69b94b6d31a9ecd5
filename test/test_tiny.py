"""The shipped tiny model (models/tiny.bin, models/tiny-dflash.bin; trained by dev/tiny/): held-out perplexity,
determinism, and DFlash on held-out code prompts (lossless, with real acceptance). The held-out set
(models/src/tiny-train/heldout.json) comes from files kept out of training by a hash of their path."""
import json
import math
import os

import pytest

from conftest import ROOT, run

MODEL = os.path.join(ROOT, "models", "tiny.bin")
DRAFT = os.path.join(ROOT, "models", "tiny-dflash.bin")
HELDOUT = os.path.join(ROOT, "models", "src", "tiny-train", "heldout.json")
PPL_BOUND = 7.0      # measured 6.365 over all 11 held-out files (dev/tiny/eval.py, 2026-11-30)
TAU_BOUND = 3.0      # the bar; this test (8 prompts x 64 tokens) measured tau 5.33, acceptance 0.315
                     # (2026-11-30, 2-core CPU); dev/tiny/eval.py's 24 prompts x 128 tokens: tau 5.89

pytestmark = pytest.mark.skipif(not os.path.exists(MODEL), reason="models/tiny.bin is not in this checkout")


@pytest.fixture(scope="module")
def heldout():
    return json.load(open(HELDOUT))


def test_heldout_perplexity(laguna, heldout, tmp_path):
    nll, n = 0.0, 0
    for f in heldout["files"]:
        ids = [2] + [int(x) for x in f["ids"].split()]
        for i in range(0, len(ids) - 1, 512):               # windows of the training length
            win = ids[i:i + 513]
            if len(win) < 2:
                continue
            p = tmp_path / "ids.txt"
            p.write_text(" ".join(map(str, win)))
            out = run([laguna, MODEL, "--score", str(p), "-q"]).stdout
            nll += float(out.split("mean_nll")[1].split()[0]) * (len(win) - 1)
            n += len(win) - 1
    ppl = math.exp(nll / n)
    print(f"\ntiny held-out perplexity {ppl:.3f} over {n} tokens (bound {PPL_BOUND})")
    assert ppl < PPL_BOUND


def test_tokenizer_matches_the_stored_ids(laguna, heldout):
    for f in sorted(heldout["files"], key=lambda f: len(f["text"]))[:4]:
        got = run([laguna, MODEL, "--tokenize", f["text"]]).stdout.split()
        assert got == f["ids"].split()


def test_first_command_writes_code_and_is_deterministic(laguna):
    a = run([laguna, MODEL, "def quicksort(arr):", "-t", "0", "-n", "60", "-q"]).stdout
    b = run([laguna, MODEL, "def quicksort(arr):", "-t", "0", "-n", "60", "-q"]).stdout
    assert a == b and ("return" in a or "def " in a or "    " in a)
    c = run([laguna, MODEL, "def quicksort(arr):", "-s", "3", "-n", "40", "-q"]).stdout
    assert c == run([laguna, MODEL, "def quicksort(arr):", "-s", "3", "-n", "40", "-q"]).stdout


def test_dflash_on_heldout_prompts(laguna, heldout):
    steps = drafted = accepted = 0
    per_pos = [0.0] * 15
    for pr in heldout["prompts"][:8]:
        cmd = [laguna, MODEL, "--raw", "-t", "0", "-n", "64", pr["text"]]
        plain = run(cmd + ["-q"]).stdout
        r = run(cmd + ["-d", DRAFT])
        assert r.stdout == plain                              # lossless
        line = [l for l in r.stderr.splitlines() if "verify steps" in l][0]
        s, d, a = (int(line.split(k)[0].split()[-1]) for k in (" verify steps", " drafted", " accepted"))
        steps, drafted, accepted = steps + s, drafted + d, accepted + a
        pos = [l for l in r.stderr.splitlines() if "per block position" in l][0].split(":")[-1].split()
        per_pos = [x + float(y) * s for x, y in zip(per_pos, pos)]
    tau = 1 + accepted / steps
    print(f"\ntiny DFlash: {steps} steps, {drafted} drafted, {accepted} accepted, acceptance {accepted / drafted:.3f}, "
          f"tau {tau:.2f} (bound {TAU_BOUND}); per position " + " ".join(f"{x / steps:.2f}" for x in per_pos))
    assert tau >= TAU_BOUND


def test_quantized_tiny_model_quality():
    """q8 within +0.5% and q4 within +6% of the unquantized perplexity on held-out code (~3,000 tokens)."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, os.path.join(ROOT, "dev", "quant_quality.py"), MODEL, HELDOUT,
                        "--max-tokens", "3000"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.split("JSON ")[1])
    print("\n" + r.stdout.split("JSON ")[0])
    assert res["q8"]["rel"] < 0.005 and res["q4"]["rel"] < 0.06
