"""Where do the GPU and CPU forwards part? (dev tool; see dev/gpu_notes.md)
Compares CPU and GPU logits position by position on (a) the xs21_bf16 fixture and (b) a small XS-2.1-width
synthetic model with --random-weights, for --chunk 1 (decode kernels) and one pass (n-token path), with the
debug hooks LAGUNA_ATTN_SCALAR=1 (plain attention kernel on the bf16 KV cache) and --kv f32 (f32 KV)."""
import os, subprocess, sys
import numpy as np
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))

def export(args, out):
    subprocess.run([sys.executable, f"{ROOT}/export.py", "-q", *args, out], check=True)

def score(model, ids_file, n, *extra, env=None):
    out = "/dev/shm/diag_logits.bin"
    r = subprocess.run([f"{ROOT}/laguna", model, "--score", ids_file, "--logits", out, "-q", *extra],
                       capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    if r.returncode: print(r.stderr); sys.exit(1)
    return np.fromfile(out, dtype=np.float32).reshape(n, -1)

def compare(label, model, ids_file, n, extra=()):
    cpu = score(model, ids_file, n, *extra, "--cpu", "--chunk", "256")
    for env, kv in (({}, "bf16"), ({"LAGUNA_ATTN_SCALAR": "1"}, "bf16"), ({}, "f32")):
        for chunk in ("1", "7", "2048"):
            g = score(model, ids_file, n, *extra, "--chunk", chunk, "--kv", kv, env=env)
            d = np.abs(g - cpu).max(1)
            agree = (g.argmax(1) == cpu.argmax(1)).mean()
            first_bad = int(np.argmax(d > 0.05)) if (d > 0.05).any() else -1
            print(f"{label} {' '.join(env) or 'default':18} kv {kv:4} chunk {chunk:>4}: max diff {d.max():.3g} "
                  f"(first row > 0.05: {first_bad}), top-1 agree {100 * agree:.1f}%")

export([f"{ROOT}/test/data/fixtures/xs21_bf16/hf"], "/dev/shm/xs21f.bin")
ids = f"{ROOT}/test/data/fixtures/xs21_bf16/score.txt"
compare("xs21_bf16", "/dev/shm/xs21f.bin", ids, len(open(ids).read().split()))
export(["--synthetic", "XS-2.1", "--layers", "2"], "/dev/shm/diag2.bin")
n = 640
open("/dev/shm/diag_ids.txt", "w").write(" ".join(map(str, np.random.default_rng(0).integers(3, 100352, size=n))))
compare("mid x2  ", "/dev/shm/diag2.bin", "/dev/shm/diag_ids.txt", n, ("--random-weights", "1", "-c", "4096"))
