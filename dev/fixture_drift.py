#!/usr/bin/env python3
"""Does the installed transformers still compute the committed fixtures? (needs torch and transformers; CPU)

test/data/fixtures/*/logits.npy were made once by test/make_fixtures.py with the transformers of that day. This loads
each fixture's checkpoint (hf/) with the transformers installed now -- the same fp32, eager attention and experts --
scores its score.txt and prints the largest difference from the committed logits, so a newer release that changed
the model's math shows up before the fixtures are trusted against it.

    python3 dev/fixture_drift.py [TOLERANCE]     (default 1e-4; exit status 1 if any fixture is farther)
"""
import os
import sys

import numpy as np
import torch
import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from make_fixtures import load_ref  # noqa: E402

FIXTURES = os.path.join(ROOT, "test", "data", "fixtures")


def main():
    tol = float(sys.argv[1]) if len(sys.argv) > 1 else 1e-4
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    worst = 0.0
    for name in sorted(os.listdir(FIXTURES)):
        d = os.path.join(FIXTURES, name)
        if not os.path.exists(os.path.join(d, "logits.npy")):
            continue                                   # rope_cases.json, the drafter fixtures (their own files)
        ids = [int(x) for x in open(os.path.join(d, "score.txt")).read().split()]
        rows, want = np.load(os.path.join(d, "rows.npy")), np.load(os.path.join(d, "logits.npy"))
        with torch.no_grad():
            got = load_ref(os.path.join(d, "hf"))(torch.tensor([ids])).logits[0].float().numpy()[rows]
        diff = float(np.abs(got - want).max())
        worst = max(worst, diff)
        print(f"{name:10s} {len(ids):5d} tokens  max |now - fixture| {diff:.3g}  (largest logit {np.abs(want).max():.3g})")
    print(f"worst {worst:.3g} (tolerance {tol:g})")
    return 0 if worst <= tol else 1


if __name__ == "__main__":
    sys.exit(main())
