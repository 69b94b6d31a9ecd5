#!/usr/bin/env python3
"""Random DFlash drafters against the reference module dev/dflash_ref.py (CPU; needs torch, transformers >= 5.17
and safetensors). For each of N random drafter configs -- 1-3 layers, GQA groups, head_dim, MLP width, gating
kinds (per head, per element, none), sliding window or full attention, every spelling of causality vLLM reads
(is_causal, dflash_config.is_causal / causal, or the layer-type default), block sizes 2-24, the mask token, tap sets
(as target_layer_ids or as vLLM's eagle_aux_hidden_state_layer_ids), RoPE theta, partial rotary, nested or flat
rope_parameters, tensor names with or without the "model." prefix -- on one of the test fixtures' targets, it writes
random weights in the on-disk layout, exports target and drafter with export.py and checks two things:
  taps    ./laguna's target taps (--score --taps) against transformers' layer outputs: max |diff| / max |taps| <= 1e-5
  drafter ./laguna's draft logits (--draft-logits) at a few committed lengths P against the reference module run on
          laguna's own taps: max |diff| <= 1e-4 (test/test_dflash.py's bar)
The drafter is compared on laguna's taps because a random drafter can amplify the taps' fp32 rounding (laguna's and
transformers' differ by ~1e-6 of their size) past 1e-4 on its own; the taps check covers the target side.

    python3 dev/dflash_fuzz.py [N] [seed]          (default 40 configs, seed 1; one line per config)
    FUZZ_ONLY=I python3 dev/dflash_fuzz.py N seed  (config I of that run alone)
    python3 dev/dflash_fuzz.py --gpu [N] [seed]    (a GPU build of ./laguna, `make cuda`: target and drafter on the
                                                    GPU; head dims it takes (16, 32) and now and then 8, which it
                                                    does not: laguna must say so and run both on the CPU; the f32
                                                    targets only, since its n-token forward rounds a bf16 file's
                                                    GEMM inputs to bf16)

Exit status 1 if any config is off either bar or fails to export / run.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import LagunaForCausalLM
from transformers.utils import logging as hf_logging

hf_logging.disable_progress_bar()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "dev"))
from dflash_ref import LagunaDFlash, target_taps  # noqa: E402

FIXTURES = os.path.join(ROOT, "test", "data", "fixtures")
TARGETS = ["xs2_f32", "variant", "tied", "ropes", "v16", "long", "xs21_bf16"]   # f32 / bf16 targets of all kinds
GPU_TARGETS = TARGETS[:-1]
TOL = 1e-4          # draft logits
TAPS_TOL = 1e-5     # taps, relative to their largest value


def random_drafter(rng, tcfg, gpu=False):
    """A drafter config for the target config tcfg (same hidden size and vocabulary)."""
    L_t = tcfg["num_hidden_layers"]
    nkv = rng.choice([1, 1, 2, 4])
    D = rng.choice([8, 16, 16, 16, 32] if gpu else [8, 12, 16, 16, 32])
    sliding = rng.random() < 0.6
    n_taps = rng.randint(1, min(5, L_t))
    taps = sorted(rng.sample(range(L_t), n_taps))
    if rng.random() < 0.3 and L_t - 1 not in taps:      # the published drafter taps the last layer
        taps[-1] = L_t - 1
    L = rng.randint(1, 3)
    dc = {"block_size": rng.choice([2, 3, 4, 8, 16, 16, 24]), "mask_token_id": rng.randrange(tcfg["vocab_size"]),
          "num_target_layers": L_t, "target_layer_ids": taps}
    cfg = dict(architectures=["DFlashLagunaForCausalLM"], model_type="laguna", vocab_size=tcfg["vocab_size"],
               hidden_size=tcfg["hidden_size"], intermediate_size=rng.choice([16, 40, 64, 96]),
               num_hidden_layers=L, num_attention_heads=nkv * rng.choice([1, 2, 3, 4]), num_key_value_heads=nkv,
               head_dim=D, layer_types=["sliding_attention" if sliding else "full_attention"] * L,
               rms_norm_eps=rng.choice([1e-6, 1e-5]), max_position_embeddings=262144,
               gating=rng.choice([True, "per-head", "per-element", False, "disabled"]))
    if sliding:
        cfg["sliding_window"] = rng.choice([2, 5, 12, 33, 64])
    if rng.random() < 0.3:
        cfg["draft_vocab_size"] = tcfg["vocab_size"]
    rope = {"rope_type": "default", "rope_theta": rng.choice([10000.0, 500000.0, 1e6])}
    if rng.random() < 0.3:
        rope["partial_rotary_factor"] = rng.choice([0.5, 1.0]) if D % 4 == 0 else 1.0
    kind = "sliding_attention" if sliding else "full_attention"
    cfg["rope_parameters"] = {kind: rope} if rng.random() < 0.5 else rope
    # causality: any of vLLM's spellings, or none (then sliding layers are causal)
    how = rng.choice(["none", "none", "causal", "dc_is_causal", "is_causal"])
    flag = rng.random() < 0.5
    if how == "causal":
        dc["causal"] = flag
    elif how == "dc_is_causal":
        dc["is_causal"] = flag
    elif how == "is_causal":
        cfg["is_causal"] = flag
    cfg["dflash_config"] = dc
    if rng.random() < 0.3:                              # vLLM's spelling of the taps: layer id + 1
        cfg["eagle_aux_hidden_state_layer_ids"] = [t + 1 for t in taps]
        if rng.random() < 0.5:
            del dc["target_layer_ids"]
    return cfg


def summary(cfg):
    dc = cfg["dflash_config"]
    lt = cfg["layer_types"][0][0]
    causal = cfg.get("is_causal", dc.get("is_causal", dc.get("causal", "-")))
    taps = dc.get("target_layer_ids") or ["e%d" % t for t in cfg["eagle_aux_hidden_state_layer_ids"]]
    return (f"L{cfg['num_hidden_layers']} heads {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} "
            f"D{cfg['head_dim']} F{cfg['intermediate_size']} {lt}{cfg.get('sliding_window', '')} causal={causal} "
            f"gating={cfg['gating']} block {dc['block_size']} mask {dc['mask_token_id']} taps {taps}")


def load_target(tmp, tname):
    """the fixture's target exported; transformers' taps after every layer (fp32), its embedding and lm_head"""
    hf = os.path.join(FIXTURES, tname, "hf")
    tcfg = json.load(open(os.path.join(hf, "config.json")))
    tbin = os.path.join(tmp, tname + ".bin")
    subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), "-q", hf, tbin], check=True)
    ids = torch.tensor(score_ids(tname))
    idf = os.path.join(tmp, tname + ".ids")
    open(idf, "w").write(" ".join(str(int(x)) for x in ids))
    ref = LagunaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ref.config._attn_implementation = "eager"
    ref.config._experts_implementation = "eager"
    return dict(tbin=tbin, ids=ids, idf=idf, taps=target_taps(ref, ids, list(range(tcfg["num_hidden_layers"]))),
                embed=ref.model.embed_tokens.weight.detach().float(), lm_head=ref.lm_head.weight.detach().float())


def score_ids(tname):
    return [int(x) for x in open(os.path.join(FIXTURES, tname, "score.txt")).read().split()][:400]


def main():
    gpu = "--gpu" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--gpu"]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__.strip())
        return
    if len(args) > 2 or not all(a.isdigit() for a in args):
        sys.exit("usage: python3 dev/dflash_fuzz.py [--gpu] [N] [seed]  (--help for more)")
    n = int(args[0]) if args else 40
    seed = int(args[1]) if len(args) > 1 else 1
    only = int(os.environ["FUZZ_ONLY"]) if os.environ.get("FUZZ_ONLY") else None   # rerun config i alone
    laguna = os.environ.get("LAGUNA", os.path.join(ROOT, "laguna"))
    where = [] if gpu else ["--cpu"]                    # (a GPU build runs the CPU path with --cpu)
    rng = random.Random(seed)
    tmp = tempfile.mkdtemp(prefix="dflash_fuzz_")      # kept with FUZZ_ONLY, to look into
    targets = {}
    worst = worst_taps = 0.0
    failures = ran = 0
    for i in range(n):
        # every random draw of config i first, so FUZZ_ONLY=i draws the same config
        tname = rng.choice(GPU_TARGETS if gpu else TARGETS)
        tcfg = json.load(open(os.path.join(FIXTURES, tname, "hf", "config.json")))
        cfg = random_drafter(rng, tcfg, gpu)
        prefixed = rng.random() < 0.3                   # some copies prefix the names with "model."
        T = len(score_ids(tname))
        checks = sorted({rng.randrange(1, T - 1) for _ in range(3)} | {min(T - 2, rng.randrange(1, 40))})
        if only is not None and i != only:
            continue
        ran += 1
        if tname not in targets:
            targets[tname] = load_target(tmp, tname)
        t = targets[tname]
        d = os.path.join(tmp, f"d{i}")
        os.makedirs(d)
        dr = LagunaDFlash(cfg).float().eval()
        gen = torch.Generator().manual_seed(seed * 1000 + i)
        dr.randomize(gen)
        sd = dr.state_for_disk()
        if prefixed:
            sd = {"model." + k: v for k, v in sd.items()}
        save_file(sd, os.path.join(d, "model.safetensors"))
        json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
        dbin = os.path.join(tmp, f"d{i}.bin")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "export.py"), "-q", d, dbin], capture_output=True,
                           text=True)
        if r.returncode:
            print(f"config {i}: export failed: {r.stderr.strip()[-300:]}  {tname}: {summary(cfg)}")
            failures += 1
            continue
        ids = t["ids"]
        tapf = os.path.join(tmp, "taps.bin")
        r = subprocess.run([laguna, t["tbin"], "-d", dbin, "--score", t["idf"], "--taps", tapf, "-q", *where],
                           capture_output=True, text=True)
        if r.returncode:
            print(f"config {i}: laguna --taps failed: {r.stderr.strip()[-300:]}")
            failures += 1
            continue
        # --gpu: a head_dim the GPU kernels lack puts target and drafter on the CPU, with a note; only then
        lacks = gpu and cfg["head_dim"] not in (16, 32, 64, 128)
        if gpu and ("running on the CPU" in r.stderr) != lacks:
            print(f"config {i}: UNEXPECTED: {'ran on the CPU' if not lacks else 'no note that it runs on the CPU'}  "
                  f"{tname}: {summary(cfg)}")
            failures += 1
            continue
        want_taps = t["taps"][:, dr.taps]
        taps = torch.from_numpy(np.fromfile(tapf, dtype=np.float32).reshape(want_taps.shape))
        taps_rel = float((taps - want_taps).abs().max() / want_taps.abs().max())
        with torch.no_grad():
            ctx = dr.context(taps)
        diff = 0.0
        for P in checks:
            out = os.path.join(tmp, "dl.bin")
            r = subprocess.run([laguna, t["tbin"], "-d", dbin, "--ids", " ".join(str(int(x)) for x in ids[:P + 1]),
                                "--draft-logits", out, "-q", *where], capture_output=True, text=True)
            if r.returncode:
                print(f"config {i}: laguna failed at P={P}: {r.stderr.strip()[-300:]}")
                diff = float("inf")
                break
            with torch.no_grad():
                want = dr.draft_logits(ctx[:P], torch.arange(P), int(ids[P]), P, dr.block, t["embed"],
                                       t["lm_head"]).numpy()
            got = np.fromfile(out, dtype=np.float32).reshape(want.shape)
            diff = max(diff, float(np.abs(got - want).max()))
        ok = diff <= TOL and taps_rel <= TAPS_TOL
        failures += not ok
        worst, worst_taps = max(worst, diff), max(worst_taps, taps_rel)
        print(f"config {i}: draft logits {diff:.3g} from the reference, taps {taps_rel:.3g} from transformers "
              f"(relative) at P {checks} {'ok' if ok else 'DIFFERS'}{' (on the CPU: head_dim)' if lacks else ''}  "
              f"{tname}: {summary(cfg)}", flush=True)
    print(f"\n{ran} drafters: {ran - failures} pass, {failures} differ or fail (worst: draft logits {worst:.3g}, "
          f"bar {TOL}; taps {worst_taps:.3g} relative, bar {TAPS_TOL})")
    if only is None:
        shutil.rmtree(tmp)
    else:
        print(f"files in {tmp}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
