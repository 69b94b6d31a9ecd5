#!/usr/bin/env python3
"""Check that LagunaDFlash.train_forward (batched, many blocks) gives the same logits as draft_logits (one block).

    python3 dev/tiny/check_train_forward.py          # exits 1 on a mismatch

Random drafters (window smaller than the context, causal and not, per-head and per-element gates), random
target taps; for several anchors P the block [bonus, MASK...] at P..P+B-1 must get the same logits both ways.
"""
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))          # dev/
from dflash_ref import LagunaDFlash  # noqa: E402


def cfg(causal, gating, window, lt="sliding_attention"):
    return dict(architectures=["DFlashLagunaForCausalLM"], model_type="laguna", vocab_size=96, hidden_size=48,
                intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, layer_types=[lt] * 2, sliding_window=window, rms_norm_eps=1e-6, gating=gating,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                dflash_config={"block_size": 8, "mask_token_id": 12, "num_target_layers": 6,
                               "target_layer_ids": [1, 3, 5], "causal": causal})


def main():
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for causal, gating, window, lt in [(True, "per-head", 12, "sliding_attention"),
                                       (False, "per-element", 5, "sliding_attention"),
                                       (True, "per-head", 512, "full_attention")]:
        d = LagunaDFlash(cfg(causal, gating, window, lt)).float().eval()
        with torch.no_grad():
            for n, p in d.named_parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 if p.dim() >= 2 else
                        torch.empty(p.shape).uniform_(0.5, 1.5, generator=g))
        N, T, H, V, B = 2, 40, 48, 96, d.block
        taps = torch.randn(N, T, 3, H, generator=g) * 3
        embed, lm_head = torch.randn(V, H, generator=g), torch.randn(V, H, generator=g) / H ** 0.5
        seq = torch.randint(13, V, (N, T), generator=g)
        anchors = torch.tensor([[1, 7, 20, 32], [3, 15, 16, 30]])
        tokens = torch.full((N, anchors.shape[1], B), d.mask_id)
        tokens[:, :, 0] = seq.gather(1, anchors)
        with torch.no_grad():
            ctx = d.context(taps.reshape(N * T, 3, H)).reshape(N, T, H)
            for attn in ("sdpa", "math"):
                hb = d.train_forward(ctx, anchors, tokens, embed, attn=attn)
                for n in range(N):
                    for k, P in enumerate(anchors[n].tolist()):
                        want = d.draft_logits(ctx[n, :P], torch.arange(P), int(seq[n, P]), P, B, embed, lm_head)
                        got = hb[n, k, 1:] @ lm_head.T
                        err = (got - want).abs().max().item() / want.abs().max().item()
                        worst = max(worst, err)
                        if err > 1e-5:
                            print(f"MISMATCH causal={causal} gating={gating} window={window} attn={attn} n={n} "
                                  f"P={P}: rel err {err:.2e}")
                            return 1
    print(f"train_forward matches draft_logits (worst relative error {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
