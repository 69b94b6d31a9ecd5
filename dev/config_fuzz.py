#!/usr/bin/env python3
"""Random Laguna configurations against the official transformers implementation (CPU; needs torch and
transformers >= 5.17). For each of N random tiny configs -- layer and MLP patterns, per-layer head counts, GQA
groups, head_dim, window, experts and top-k, gating kinds, attention bias, router softcapping, tied embeddings,
rope variants (yarn / default / linear, partial rotary), f32 or bf16 checkpoints -- it saves a randomized model with
save_pretrained, exports it with export.py, scores a random sequence with ./laguna (CPU) and compares every row of
logits with transformers' (fp32 eager math; bf16 checkpoints upcast, as laguna computes them). A config passes when
laguna is within 1e-4 of transformers' fp32 logits, or -- some random configs are ill-conditioned enough that fp32
itself drifts that far -- no farther from transformers' fp64 logits than twice transformers' own fp32 drift.

    python3 dev/config_fuzz.py [N] [seed]        (default 30 configs, seed 1; prints one line per config)
    python3 dev/config_fuzz.py --gpu [N] [seed]  (a GPU build of ./laguna, `make cuda`: the GPU too, see below)
    python3 dev/config_fuzz.py --ropes [N] [seed]  (every fixed-table RoPE kind: llama3, dynamic and proportional
                                                    too, and odd rotary dims; with or without --gpu)

With --gpu, head_dim is drawn from what the GPU backend takes (16, 32, 64; now and then 8, which it does not: ./laguna
must say so and run that config on the CPU, counted apart) and every config also runs on the GPU with an f32 KV
cache, one pass (the n-token kernels) and token by token (--chunk 1: the one-token decode kernels, router and fused
attention included): an f32 checkpoint is held to the same rule against transformers; a bf16 one token by token to
1e-4 from the CPU (the same bf16 weights, fp32 math; its n-token forward rounds the GEMM inputs to bf16, so it has no
such bar).

Configurations transformers itself refuses are skipped and counted. Exit status 1 if any config differs by more
than 1e-4 or fails to export / run.
"""
import json
import os
import random
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import LagunaConfig, LagunaForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from make_fixtures import XS2_FULL, XS21_FULL, load_ref, randomize  # noqa: E402


def random_config(rng, gpu=False):
    L = rng.randint(1, 6)
    kv = rng.choice([1, 2, 4])
    D = rng.choice([16, 32, 64, 16, 32, 8] if gpu else [8, 16, 32])
    types = [rng.choice(["full_attention", "sliding_attention"]) for _ in range(L)]
    mlp = [rng.choice(["dense", "sparse"]) for _ in range(L)]
    E = rng.choice([4, 8, 16] + ([32, 64] if gpu else []))
    full = rng.choice([dict(XS2_FULL), dict(XS21_FULL), {"rope_type": "default", "rope_theta": 50000.0},
                       {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}])
    full = dict(full, factor=rng.choice([4.0, 32.0])) if full.get("rope_type") == "yarn" else full
    full["partial_rotary_factor"] = rng.choice([1.0, 0.5, 0.25])
    sliding = {"rope_type": "default", "rope_theta": rng.choice([10000.0, 5000.0]),
               "partial_rotary_factor": rng.choice([1.0, 0.5])}
    vocab = rng.choice([64, 130, 300])
    hidden = rng.choice([32, 48, 64] + ([128, 256] if gpu else []))   # (drawn in this order: the seeds' configs)
    return dict(vocab_size=vocab, hidden_size=hidden,
                intermediate_size=rng.choice([48, 96]), num_hidden_layers=L, num_attention_heads=kv,
                num_key_value_heads=kv, head_dim=D,
                num_attention_heads_per_layer=[kv * rng.choice([1, 2, 3, 4] + ([6, 8, 12] if gpu else []))
                                               for _ in range(L)],
                layer_types=types, mlp_layer_types=mlp, sliding_window=rng.randint(3, 40 if gpu else 12),
                moe_intermediate_size=rng.choice([16, 32]), shared_expert_intermediate_size=rng.choice([16, 24]),
                num_experts=E, num_experts_per_tok=rng.randint(1, min(8 if gpu else 4, E)),
                moe_routed_scaling_factor=rng.choice([1.0, 2.5]), gating=rng.choice([True, False, "per-element"]),
                attention_bias=rng.random() < 0.3,
                moe_router_logit_softcapping=rng.choice([0.0, 0.0, 3.0, 30.0]),
                rms_norm_eps=rng.choice([1e-6, 1e-5]), max_position_embeddings=131072, bos_token_id=2,
                eos_token_id=[2], pad_token_id=0, tie_word_embeddings=rng.random() < 0.3,
                rope_parameters={"full_attention": full, "sliding_attention": sliding})


def wider_ropes(cd, rng):
    """--ropes: each layer type's RoPE drawn again from every fixed-table kind transformers has (llama3, dynamic,
    proportional too) with partial factors that give odd rotary dims. A second generator, so that the configs of a
    seed without --ropes stay what they were."""
    D = cd["head_dim"]
    for lt, theta in (("full_attention", 500000.0), ("sliding_attention", 10000.0)):
        prf = rng.choice([1.0, 0.5, 0.25, 0.3125, 0.375, 0.6])
        kind = rng.choice(["default", "linear", "yarn", "llama3", "dynamic", "proportional"])
        p = {"rope_type": kind, "rope_theta": theta, "partial_rotary_factor": prf}
        if kind == "linear":
            p["factor"] = rng.choice([2.0, 4.0])
        elif kind == "yarn":
            p = dict(XS21_FULL, factor=rng.choice([4.0, 32.0]),
                     partial_rotary_factor=rng.choice([1.0, 0.5, 0.25]))   # (odd dims: transformers fails)
        elif kind == "llama3":
            p.update(factor=rng.choice([8.0, 32.0]), low_freq_factor=1.0, high_freq_factor=rng.choice([4.0, 8.0]),
                     original_max_position_embeddings=rng.choice([8, 16, 64]))   # (wavelengths of a few tokens)
        elif kind == "dynamic":
            p["factor"] = rng.choice([2.0, 4.0])
            if int(D * prf) <= 2:
                p["partial_rotary_factor"] = 1.0
        elif kind == "proportional" and rng.random() < 0.5:
            p["factor"] = rng.choice([2.0, 8.0])
        cd["rope_parameters"][lt] = p
    return cd


def rope_summary(p):
    return f"{p.get('rope_type')}/{p.get('partial_rotary_factor', 1.0)}"


def gpu_checks(laguna, binf, idf, d, T, dtype, want, want64, drift, cpu):
    """The GPU's logits (f32 KV cache) one pass and token by token: (label, max diff, ok) each, or a failure's text;
    and whether laguna said it runs the model on the CPU instead (a head_dim the GPU kernels lack)"""
    out, fell_back = [], False
    modes = (("one pass", []), ("token by token", ["--chunk", "1"]))
    for label, extra in modes if dtype == "f32" else modes[1:]:   # (bf16 files' n-token GEMMs round x to bf16)
        lg = os.path.join(d, "gpu.bin")
        r = subprocess.run([laguna, binf, "--kv", "f32", "--score", idf, "--logits", lg, "-q", *extra],
                           capture_output=True, text=True)
        if r.returncode:
            return r.stderr.strip(), False
        fell_back = fell_back or "running on the CPU" in r.stderr
        got = np.fromfile(lg, dtype=np.float32).reshape(T, -1)
        if dtype == "f32":                             # fp32 end to end: the CPU's rule against transformers
            diff = float(np.abs(got - want).max())
            ok = diff <= 1e-4 or float(np.abs(got - want64).max()) <= 2 * drift
        else:                                          # bf16 weights, fp32 math: the CPU's numbers
            diff = float(np.abs(got - cpu).max())
            ok = diff <= 1e-4
        out.append((label, diff, ok))
    return out, fell_back


def main():
    args = sys.argv[1:]
    gpu, ropes = "--gpu" in args, "--ropes" in args
    args = [a for a in args if a not in ("--gpu", "--ropes")]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return 0
    if len(args) > 2 or not all(a.isdigit() for a in args):
        sys.exit("usage: python3 dev/config_fuzz.py [--gpu] [--ropes] [N] [seed]  (--help for more)")
    n = int(args[0]) if len(args) > 0 else 30
    seed = int(args[1]) if len(args) > 1 else 1
    rng = random.Random(seed)
    rope_rng = random.Random(seed * 7919 + 1) if ropes else None
    laguna = os.path.join(ROOT, "laguna")
    worst, bad, refused, gpu_fell_back, gpu_worst = 0.0, 0, 0, 0, 0.0
    for i in range(n):
        cd = random_config(rng, gpu)
        if rope_rng:
            wider_ropes(cd, rope_rng)
        dtype = rng.choice(["f32", "bf16"])
        try:
            cfg = LagunaConfig(**cd)
            model = LagunaForCausalLM(cfg).float().eval()
        except Exception as e:      # transformers refuses the combination: nothing to compare
            refused += 1
            print(f"config {i}: transformers refuses it ({type(e).__name__}: {str(e)[:80]})")
            continue
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        randomize(model, cfg, gen)
        if dtype == "bf16":
            model = model.to(torch.bfloat16)
        with tempfile.TemporaryDirectory() as d:
            hf = os.path.join(d, "hf")
            model.save_pretrained(hf)
            ref = load_ref(hf)
            T = rng.randint(5, 80 if gpu else 40)
            ids = torch.randint(3, cfg.vocab_size, (T,), generator=gen)
            ref64 = load_ref(hf, torch.float64)
            with torch.no_grad():
                want = ref(ids[None]).logits[0].float().numpy()
                want64 = ref64(ids[None]).logits[0].numpy()
            binf, idf, lgf = os.path.join(d, "m.bin"), os.path.join(d, "ids.txt"), os.path.join(d, "lg.bin")
            with open(idf, "w") as f:
                f.write(" ".join(map(str, ids.tolist())))
            summary = (f"L{cfg.num_hidden_layers} H{cfg.hidden_size} D{cfg.head_dim} kv{cfg.num_key_value_heads} "
                       f"heads{cfg.num_attention_heads_per_layer} {''.join(t[0] for t in cfg.layer_types)}/"
                       f"{''.join(t[0] for t in cfg.mlp_layer_types)} W{cfg.sliding_window} E{cfg.num_experts}"
                       f"k{cfg.num_experts_per_tok} gating={cfg.gating} bias={cfg.attention_bias} "
                       f"cap={cfg.moe_router_logit_softcapping} tied={cfg.tie_word_embeddings} "
                       f"rope={rope_summary(cd['rope_parameters']['full_attention'])}"
                       + (f",{rope_summary(cd['rope_parameters']['sliding_attention'])}" if rope_rng else "")
                       + f" {dtype} T{T}")
            r = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), "-q", hf, binf],
                               capture_output=True, text=True)
            if r.returncode:
                bad += 1
                print(f"config {i}: EXPORT FAILED {summary}\n{r.stderr[-400:]}")
                continue
            r = subprocess.run([laguna, binf, "--cpu", "--score", idf, "--logits", lgf, "-q"],
                               capture_output=True, text=True)
            if r.returncode:
                bad += 1
                print(f"config {i}: RUN FAILED {summary}\n{r.stderr[-400:]}")
                continue
            got = np.fromfile(lgf, dtype=np.float32).reshape(T, -1)
            diff = float(np.abs(got - want).max())
            d64, drift = float(np.abs(got - want64).max()), float(np.abs(want - want64).max())
            worst = max(worst, diff)
            ok = diff <= 1e-4 or d64 <= 2 * drift
            line = (f"config {i}: max |laguna - transformers| {diff:.2e} (vs fp64 {d64:.2e}; transformers fp32 vs "
                    f"fp64 {drift:.2e}) {'ok' if ok else 'DIFFERS'}")
            if gpu:
                res, fell_back = gpu_checks(laguna, binf, idf, d, T, dtype, want, want64, drift, got)
                lacks = cfg.head_dim not in (16, 32, 64, 128)   # then (only then) the run says it is on the CPU
                if isinstance(res, str):
                    ok = False
                    line += f"; GPU run FAILS: {res.splitlines()[0][:70]}"
                else:
                    if fell_back != lacks:
                        ok = False
                        line += "; UNEXPECTED: " + ("ran on the CPU" if fell_back else
                                                    "no note that it runs on the CPU")
                    elif lacks:
                        gpu_fell_back += 1
                        line += "; on the CPU (head_dim)"
                    for label, gd, gok in res:
                        gpu_worst = gpu_worst if fell_back else max(gpu_worst, gd)
                        ok = ok and gok
                        line += f"; GPU {label} {gd:.2e}{'' if gok else ' DIFFERS'}"
            bad += not ok
            print(f"{line}  {summary}", flush=True)
    print(f"\n{n} configs: {n - refused - bad} match (worst |laguna - transformers fp32| {worst:.2e}), {bad} differ "
          f"or fail, {refused} refused by transformers")
    if gpu:
        print(f"GPU: worst {gpu_worst:.2e} (f32 files from transformers, bf16 files from the CPU), {gpu_fell_back} "
              f"configs run on the CPU as expected (head_dim)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
