#!/usr/bin/env python3
"""Make the golden fixtures: tiny random Laguna checkpoints from the official transformers implementation.

    python3 test/make_fixtures.py            # needs torch and transformers >= 5.17 (CPU is enough)

For each fixture, test/data/fixtures/NAME/ holds
    hf/            the checkpoint, saved with save_pretrained (the real on-disk tensor names) + generation_config
    prompt.txt     prompt token ids
    greedy.txt     transformers' greedy continuation (full forward each step, stops before an EOS id)
    score.txt      the ids of the teacher-forced sequence
    logits.npy     float32 reference logits for the rows in rows.npy of score.txt
    rows.npy       which rows of the logits are kept (all of them for short sequences)
    logits_kvbf16.npy  (bf16 fixtures) the same with every K and V rounded to bf16 as the cache takes it (a cache
                   subclass): what laguna's --kv bf16 computes; `--kv-bf16-only` remakes these alone
    ref.json       rope tables (inv_freq as hex) and attention scaling, as transformers computed them
plus test/data/fixtures/rope_cases.json: transformers' rope tables for config variants (config drift).

Fixtures run in fp32 math with eager attention and eager experts (ascending expert id summation).
Norm weights and the correction bias are randomized; weights are scaled so attention and routing are sharp.
"""
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import LagunaConfig, LagunaForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "data", "fixtures")
TOK_DIR = os.path.join(HERE, "data", "tokenizer")

XS2_FULL = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
            "beta_slow": 1.0, "beta_fast": 64.0, "attention_factor": 1.0, "partial_rotary_factor": 0.5}
XS21_FULL = dict(XS2_FULL, original_max_position_embeddings=8192, attention_factor=1.3465735902799727)
SLIDING = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}


def base_config(**kw):
    c = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_attention_heads_per_layer=[4, 8, 8, 8],
             layer_types=["full_attention"] + ["sliding_attention"] * 3, mlp_layer_types=["dense"] + ["sparse"] * 3,
             sliding_window=8, moe_intermediate_size=32, shared_expert_intermediate_size=24, num_experts=8,
             num_experts_per_tok=3, moe_routed_scaling_factor=2.5, gating=True, rms_norm_eps=1e-6,
             max_position_embeddings=131072, bos_token_id=2, eos_token_id=[2, 24], pad_token_id=9,
             tie_word_embeddings=False,
             rope_parameters={"full_attention": dict(XS2_FULL), "sliding_attention": dict(SLIDING)})
    c.update(kw)
    return c


FIXTURES = {
    # XS.2 rope (attention factor 1.0, original 4096), fp32, the default 1 full : 3 sliding pattern, 8 layers so
    # there are two full layers and six MoE layers, heads differ between full and sliding layers
    "xs2_f32": dict(cfg=base_config(num_hidden_layers=8, num_attention_heads_per_layer=[4, 8, 8, 8] * 2,
                                    layer_types=(["full_attention"] + ["sliding_attention"] * 3) * 2,
                                    mlp_layer_types=["dense"] + ["sparse"] * 7),
                    dtype="f32", prompt_len=40, gen=24),
    # XS-2.1 rope (attention factor 1.3466, original 8192) in bf16, with the synthetic tokenizer and chat template
    "xs21_bf16": dict(cfg=base_config(vocab_size=4096, rope_parameters={"full_attention": dict(XS21_FULL),
                                                                       "sliding_attention": dict(SLIDING)}),
                      dtype="bf16", prompt_len=40, gen=24, tokenizer=True),
    # a layer pattern that is not the default, per-element gating, attention biases, router softcapping,
    # dense layers in the middle, GQA groups of 1, 2 and 3
    "variant": dict(cfg=base_config(num_hidden_layers=6, num_key_value_heads=2,
                                    num_attention_heads_per_layer=[2, 6, 4, 4, 6, 2],
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                 "sliding_attention", "full_attention", "sliding_attention"],
                                    mlp_layer_types=["sparse", "dense", "sparse", "sparse", "dense", "sparse"],
                                    gating="per-element", attention_bias=True, moe_router_logit_softcapping=3.0,
                                    num_experts=16, num_experts_per_tok=4, moe_routed_scaling_factor=1.5,
                                    sliding_window=5,
                                    rope_parameters={"full_attention": dict(XS21_FULL, partial_rotary_factor=0.25),
                                                     "sliding_attention": dict(SLIDING, rope_theta=5000.0)}),
                    dtype="f32", prompt_len=33, gen=24),
    # a 16-token vocabulary: exact token distributions for the DFlash sampling test
    "v16": dict(cfg=base_config(vocab_size=16, eos_token_id=[15], bos_token_id=1, pad_token_id=0),
                dtype="f32", prompt_len=12, gen=8),
    # tied embeddings (no lm_head on disk) and gating=false, which transformers reads as per-element
    "tied": dict(cfg=base_config(tie_word_embeddings=True, gating=False), dtype="f32", prompt_len=20, gen=12),
    # the other fixed-table RoPE kinds: llama3 on full layers with an odd rotary dim (16 * 0.3125 = 5: transformers
    # rotates 6 dims, a table of 3), proportional on sliding layers (every dim in pairs, half at frequency 0)
    "ropes": dict(cfg=base_config(rope_parameters={
        "full_attention": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
                           "partial_rotary_factor": 0.3125},
        "sliding_attention": {"rope_type": "proportional", "rope_theta": 10000.0, "factor": 2.0,
                              "partial_rotary_factor": 0.5}}),
        dtype="f32", prompt_len=40, gen=16),
    # config and checkpoint quirks that transformers resolves on load (the edits below are applied after
    # save_pretrained, before transformers loads the reference): an odd head_dim (9; rotary dims 4 and 8);
    # tie_word_embeddings true but an lm_head.weight of other values on disk (transformers then does not tie);
    # rope_scaling beside a different rope_parameters (rope_scaling is transformers' alias and wins); a
    # dflash_config in a target's config
    "quirks": dict(cfg=base_config(vocab_size=256, num_hidden_layers=3, num_attention_heads_per_layer=[4, 8, 4],
                                   layer_types=["full_attention", "sliding_attention", "sliding_attention"],
                                   mlp_layer_types=["dense", "sparse", "sparse"], head_dim=9,
                                   tie_word_embeddings=True,
                                   rope_parameters={"full_attention": dict(XS21_FULL, partial_rotary_factor=0.5),
                                                    "sliding_attention": dict(SLIDING, partial_rotary_factor=8 / 9)}),
                   dtype="f32", prompt_len=24, gen=12,
                   edit_config={"rope_scaling": "rope_parameters",
                                "rope_parameters": {"full_attention": dict(SLIDING, rope_theta=77.0),
                                                    "sliding_attention": dict(SLIDING, rope_theta=55.0)},
                                "dflash_config": {"block_size": 16, "mask_token_id": 12, "num_target_layers": 3,
                                                  "target_layer_ids": [0, 1], "causal": True}},
                   edit_tensors="untie"),
    # head_dim absent from config.json (transformers' default, 128, is the checkpoint's) and tied embeddings
    # with only lm_head.weight on disk (transformers ties the embedding to it)
    "quirks2": dict(cfg=base_config(vocab_size=256, num_hidden_layers=2, num_attention_heads_per_layer=[2, 2],
                                    layer_types=["sliding_attention", "full_attention"],
                                    mlp_layer_types=["sparse", "dense"], head_dim=128, tie_word_embeddings=True),
                    dtype="f32", prompt_len=24, gen=12, edit_config={"head_dim": None}, edit_tensors="embed_as_lm_head"),
    # a long run: thousands of positions, many trips around the sliding ring
    "long": dict(cfg=base_config(vocab_size=256, sliding_window=16,
                                 rope_parameters={"full_attention": dict(XS21_FULL),
                                                  "sliding_attention": dict(SLIDING)}),
                 dtype="f32", prompt_len=3000, gen=0, keep_rows="sparse"),
}


def randomize(model, cfg, gen):
    """Non-trivial norms and bias; weights scaled so activations are O(1) and softmaxes are sharp."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                lo, hi = (0.8, 2.0) if ("q_norm" in name or "k_norm" in name) else (0.5, 1.5)
                p.copy_(torch.empty_like(p).uniform_(lo, hi, generator=gen))
            elif "e_score_correction_bias" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif p.dim() >= 2:
                fan_in = p.shape[-1]
                scale = 2.0 if name.endswith("gate.weight") else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) * scale / fan_in ** 0.5)
            else:   # biases
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)


def edit_checkpoint(hf, fx, gen):
    """fx's edits after save_pretrained: config.json keys (None deletes; the name of another key copies its value)
    and the tensors ("untie": a different lm_head.weight beside the embedding; "embed_as_lm_head": the embedding
    stored as lm_head.weight only)"""
    from safetensors.torch import load_file, save_file
    if fx.get("edit_config"):
        path = os.path.join(hf, "config.json")
        c = json.load(open(path))
        old = dict(c)
        for k, v in fx["edit_config"].items():
            if v is None:
                c.pop(k, None)
            else:
                c[k] = old[v] if isinstance(v, str) and v in old else v
        json.dump(c, open(path, "w"), indent=2)
    if fx.get("edit_tensors"):
        path = os.path.join(hf, "model.safetensors")
        t = load_file(path)
        e = t.pop("model.embed_tokens.weight") if fx["edit_tensors"] == "embed_as_lm_head" \
            else t["model.embed_tokens.weight"]
        t["lm_head.weight"] = e.clone() if fx["edit_tensors"] == "embed_as_lm_head" else \
            torch.randn(e.shape, generator=gen) / e.shape[1] ** 0.5
        save_file(t, path, metadata={"format": "pt"})


def hexs(t):
    return " ".join("%08x" % x for x in t.detach().float().numpy().view(np.uint32))


def load_ref(hf, dtype=torch.float32):
    """the checkpoint in fp32 (or dtype) math, eager attention and eager experts"""
    ref = LagunaForCausalLM.from_pretrained(hf, dtype=dtype).eval()
    ref.config._attn_implementation = "eager"
    ref.config._experts_implementation = "eager"
    try:
        ref.set_attn_implementation("eager")
        ref.set_experts_implementation("eager")
    except Exception:
        pass
    return ref


class BF16KVCache(transformers.DynamicCache):
    """a cache that keeps K and V rounded to bf16 (round to nearest even), as they come from q/k norm and RoPE"""
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        rnd = lambda t: t.to(torch.bfloat16).to(t.dtype)
        return super().update(rnd(key_states), rnd(value_states), layer_idx, *args, **kwargs)


def kv_bf16_fixtures():
    """logits_kvbf16.npy for the bf16 fixtures: score.txt through the reference with a bf16-rounding cache"""
    for name, fx in FIXTURES.items():
        d = os.path.join(OUT, name)
        if fx["dtype"] != "bf16" or not os.path.exists(d):
            continue
        ref = load_ref(os.path.join(d, "hf"))
        ids = torch.tensor([int(x) for x in open(os.path.join(d, "score.txt")).read().split()])
        with torch.no_grad():
            logits = ref(ids[None], past_key_values=BF16KVCache(config=ref.config), use_cache=True).logits[0]
        rows = np.load(os.path.join(d, "rows.npy"))
        np.save(os.path.join(d, "logits_kvbf16.npy"), logits.float().numpy()[rows].astype(np.float32))
        base = np.load(os.path.join(d, "logits.npy"))
        print(f"{name}: logits_kvbf16.npy, max |kv bf16 - fp32 cache| {np.abs(logits.numpy()[rows] - base).max():.3g}")


def main():
    if sys.argv[1:] == ["--rope-only"]:
        return rope_cases()
    if sys.argv[1:] == ["--kv-bf16-only"]:
        return kv_bf16_fixtures()
    if sys.argv[1:] == ["--dflash-only"]:
        return dflash_fixtures()
    print("transformers", transformers.__version__, "torch", torch.__version__)
    torch.manual_seed(0)
    os.makedirs(OUT, exist_ok=True)
    only = sys.argv[2:] if sys.argv[1:2] == ["--only"] else None
    for name, fx in FIXTURES.items():
        if only and name not in only:
            continue
        d = os.path.join(OUT, name)
        if os.path.exists(d):
            shutil.rmtree(d)
        hf = os.path.join(d, "hf")
        os.makedirs(hf)
        gen = torch.Generator().manual_seed(zlib_crc(name))
        cfg = LagunaConfig(**fx["cfg"])
        model = LagunaForCausalLM(cfg).float().eval()
        randomize(model, cfg, gen)
        if fx["dtype"] == "bf16":
            model = model.to(torch.bfloat16)      # the checkpoint is bf16 ...
        model.save_pretrained(hf)
        edit_checkpoint(hf, fx, gen)
        if fx.get("tokenizer"):
            for f in os.listdir(TOK_DIR):
                if os.path.isfile(os.path.join(TOK_DIR, f)):
                    shutil.copy(os.path.join(TOK_DIR, f), hf)
        # ... and the reference runs it in fp32 (bf16 weights upcast): the math laguna does
        ref = load_ref(hf)
        V = cfg.vocab_size
        n = fx["prompt_len"]
        ids = torch.randint(70 if V > 512 else 3 if V > 16 else 1, V - 1 if V <= 16 else V, (n,), generator=gen)
        eos = set(cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id])
        with torch.no_grad():
            cont = []
            seq = ids.clone()
            for _ in range(fx["gen"]):
                nxt = int(ref(seq[None]).logits[0, -1].argmax())
                if nxt in eos:
                    break
                cont.append(nxt)
                seq = torch.cat([seq, torch.tensor([nxt])])
            score_ids = seq if fx["gen"] else ids
            logits = ref(score_ids[None]).logits[0].float().numpy()
        if fx.get("keep_rows") == "sparse":
            T = len(score_ids)
            rows = np.unique(np.concatenate([np.arange(16), np.arange(16, T, 97), np.arange(T - 16, T)]))
        else:
            rows = np.arange(len(score_ids))
        np.save(os.path.join(d, "logits.npy"), logits[rows].astype(np.float32))
        np.save(os.path.join(d, "rows.npy"), rows.astype(np.int64))
        with open(os.path.join(d, "prompt.txt"), "w") as f:
            f.write(" ".join(map(str, ids.tolist())) + "\n")
        with open(os.path.join(d, "greedy.txt"), "w") as f:
            f.write(" ".join(map(str, cont)) + "\n")
        with open(os.path.join(d, "score.txt"), "w") as f:
            f.write(" ".join(map(str, score_ids.tolist())) + "\n")
        rot = ref.model.rotary_emb
        info = {"dtype": fx["dtype"], "transformers": transformers.__version__, "rope": {}}
        for lt in sorted(set(cfg.layer_types)):
            info["rope"][lt] = {"inv_freq": hexs(getattr(rot, f"{lt}_inv_freq")),
                                "attention_scaling": float(getattr(rot, f"{lt}_attention_scaling"))}
        with open(os.path.join(d, "ref.json"), "w") as f:
            json.dump(info, f, indent=1)
        names = sorted(json.load(open(os.path.join(hf, "model.safetensors.index.json")))["weight_map"]) \
            if os.path.exists(os.path.join(hf, "model.safetensors.index.json")) else None
        print(f"{name}: {len(score_ids)} tokens, greedy {len(cont)}, logits |max| {np.abs(logits).max():.3f}"
              + (f", {len(names)} tensors" if names else ""))
    if only:
        return
    kv_bf16_fixtures()
    rope_cases()
    dflash_fixtures()


# DFlash drafters for two of the targets: random weights in the on-disk layout of Laguna-XS-2.1-DFlash,
# built with the reference module dev/dflash_ref.py, plus its draft logits on transformers' target taps
DRAFTERS = {
    "draft_xs2": dict(target="xs2_f32", cfg=dict(
        architectures=["DFlashLagunaForCausalLM"], model_type="laguna", vocab_size=512, draft_vocab_size=512,
        hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, layer_types=["sliding_attention"] * 2, sliding_window=12, rms_norm_eps=1e-6, gating="per-head",
        max_position_embeddings=262144, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        dflash_config={"block_size": 16, "mask_token_id": 12, "num_target_layers": 8, "target_layer_ids": [1, 4, 7],
                       "causal": True}), checks=[5, 20, 40]),
    "draft_v16": dict(target="v16", cfg=dict(
        architectures=["DFlashLagunaForCausalLM"], model_type="laguna", vocab_size=16, draft_vocab_size=16,
        hidden_size=64, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, layer_types=["full_attention"], rms_norm_eps=1e-6, gating="per-element",
        max_position_embeddings=262144, rope_parameters={"full_attention": {"rope_type": "default",
                                                                            "rope_theta": 500000.0}},
        dflash_config={"block_size": 4, "mask_token_id": 12, "num_target_layers": 4, "target_layer_ids": [0, 3],
                       "causal": False}), checks=[3, 12]),
}


def dflash_fixtures():
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "dev"))
    from dflash_ref import LagunaDFlash, target_taps
    from safetensors.torch import save_file
    for name, dx in DRAFTERS.items():
        d = os.path.join(OUT, name)
        if os.path.exists(d):
            shutil.rmtree(d)
        os.makedirs(os.path.join(d, "hf"))
        gen = torch.Generator().manual_seed(zlib_crc(name))
        dr = LagunaDFlash(dx["cfg"]).float().eval()
        dr.randomize(gen)
        save_file(dr.state_for_disk(), os.path.join(d, "hf", "model.safetensors"))
        with open(os.path.join(d, "hf", "config.json"), "w") as f:
            json.dump(dx["cfg"], f, indent=1)
        tgt = os.path.join(OUT, dx["target"])
        ref = LagunaForCausalLM.from_pretrained(os.path.join(tgt, "hf"), dtype=torch.float32).eval()
        ref.config._attn_implementation = "eager"
        ref.config._experts_implementation = "eager"
        ids = torch.tensor([int(x) for x in open(os.path.join(tgt, "score.txt")).read().split()])
        taps = target_taps(ref, ids, dr.taps)
        np.save(os.path.join(d, "taps.npy"), taps.numpy().astype(np.float32))
        embed, lm_head = ref.model.embed_tokens.weight.detach(), ref.lm_head.weight.detach()
        with torch.no_grad():
            ctx = dr.context(taps)
            for P in dx["checks"]:
                lg = dr.draft_logits(ctx[:P], torch.arange(P), int(ids[P]), P, dr.block, embed, lm_head)
                np.save(os.path.join(d, f"draft_logits_{P}.npy"), lg.numpy().astype(np.float32))
        print(f"{name}: drafter for {dx['target']}, taps {dr.taps}, checks at {dx['checks']}")


def zlib_crc(s):
    import zlib
    return zlib.crc32(s.encode())


def rope_cases():
    """transformers' rope tables for config variants: what export.py must reproduce bit for bit."""
    cases = {
        "xs2": {"full_attention": XS2_FULL, "sliding_attention": SLIDING},
        "xs21": {"full_attention": XS21_FULL, "sliding_attention": SLIDING},
        "xs21_no_attention_factor": {"full_attention": {k: v for k, v in XS21_FULL.items() if k != "attention_factor"},
                                     "sliding_attention": SLIDING},
        "missing_original_max": {"full_attention": {k: v for k, v in XS2_FULL.items()
                                                    if k != "original_max_position_embeddings"},
                                 "sliding_attention": SLIDING},
        "factor64": {"full_attention": dict(XS2_FULL, factor=64.0), "sliding_attention": SLIDING},
        "mixed_flat_and_nested": {"full_attention": XS21_FULL, "sliding_attention": SLIDING,
                                  "rope_type": "yarn", "factor": 8.0},
        "truncate_false": {"full_attention": XS2_FULL, "sliding_attention": SLIDING, "truncate": False},
        "linear_sliding": {"full_attention": XS2_FULL,
                           "sliding_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        "mscale": {"full_attention": {k: v for k, v in dict(XS2_FULL, mscale=1.0, mscale_all_dim=0.5).items()
                                      if k != "attention_factor"}, "sliding_attention": SLIDING},
        "llama3": {"full_attention": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192, "partial_rotary_factor": 0.5},
                   "sliding_attention": SLIDING},
        "dynamic": {"full_attention": {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 4.0,
                                       "partial_rotary_factor": 0.5},
                    "sliding_attention": dict(SLIDING, rope_type="dynamic", factor=2.0)},
        "proportional": {"full_attention": {"rope_type": "proportional", "rope_theta": 500000.0, "factor": 8.0,
                                            "partial_rotary_factor": 0.25},
                         "sliding_attention": dict(SLIDING, rope_type="proportional")},
    }
    out = {}
    for name, rp in cases.items():
        cfgd = base_config(head_dim=128, max_position_embeddings=262144,
                           rope_parameters=json.loads(json.dumps(rp)))
        from transformers.models.laguna.modeling_laguna import LagunaRotaryEmbedding
        try:
            rot = LagunaRotaryEmbedding(LagunaConfig(**cfgd))
        except Exception as e:          # transformers refuses this config: export.py must refuse it too
            out[name] = {"config": {"head_dim": 128, "max_position_embeddings": 262144, "rope_parameters": rp},
                         "error": f"{type(e).__name__}: {e}"}
            continue
        out[name] = {"config": {"head_dim": 128, "max_position_embeddings": 262144, "rope_parameters": rp},
                     "tables": {lt: {"inv_freq": hexs(getattr(rot, f"{lt}_inv_freq")),
                                     "attention_scaling": float(getattr(rot, f"{lt}_attention_scaling"))}
                                for lt in ("full_attention", "sliding_attention")}}
    with open(os.path.join(OUT, "rope_cases.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(f"rope_cases.json: {len(out)} cases")


if __name__ == "__main__":
    sys.exit(main())
