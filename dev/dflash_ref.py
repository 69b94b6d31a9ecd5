#!/usr/bin/env python3
"""A PyTorch module of the Laguna DFlash drafter, written from ../shared/spec/dflash.md (sections 2a-2d) and
vLLM's laguna_dflash.py conventions. It is the reference the C drafter is checked against, and the model the
tiny-model training will use. Standalone: needs torch only (safetensors to save/load).

    drafter = LagunaDFlash(cfg)                        # cfg: the drafter's config.json as a dict
    ctx = drafter.context(taps)                        # taps [T, n_taps, H] -> fused context [T, H]
    logits = drafter.draft_logits(ctx, ctx_pos, bonus, P, block, embed, lm_head)   # [block-1, V]

What it computes, for a bonus token b at absolute position P (= committed length):
  context  c_j = hidden_norm(fc(concat_i aux_norm_i(tap_i[j])))                  for committed j < P
  per draft layer l:  context K/V from input_layernorm_l(c_j): k -> k_norm -> RoPE(j), v
  block    h = E[b, MASK, ..., MASK] at positions P..P+B-1; pre-norm layers whose attention sees the
           context keys j >= q_pos - (W-1) and the block keys o' <= o (causal), softplus per-head gate
  logits   lm_head(norm(h))[1:]     slot o predicts the token at position P+o
"""
import math

import torch
import torch.nn.functional as F
from torch import nn


def rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def rope_inv_freq(theta, dim):
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def apply_rope(x, pos, inv_freq, scaling=1.0):
    """x [T, heads, D]; NeoX rotate-half on the first len(inv_freq)*2 dims."""
    rd = inv_freq.numel() * 2
    freqs = pos.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (emb.cos() * scaling)[:, None, :], (emb.sin() * scaling)[:, None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


def apply_rope_nd(x, pos, inv_freq, scaling=1.0):
    """apply_rope for any leading dims: x [..., T, heads, D], pos [..., T]."""
    rd = inv_freq.numel() * 2
    freqs = pos.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (emb.cos() * scaling)[..., None, :], (emb.sin() * scaling)[..., None, :]
    xr, xp = x[..., :rd], x[..., rd:]
    x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


class Layer(nn.Module):
    def __init__(self, H, nh, nkv, D, F_, gating):
        super().__init__()
        self.nh, self.nkv, self.D = nh, nkv, D
        self.input_layernorm = nn.Parameter(torch.ones(H))
        self.post_attention_layernorm = nn.Parameter(torch.ones(H))
        self.qkv_proj = nn.Linear(H, (nh + 2 * nkv) * D, bias=False)
        self.o_proj = nn.Linear(nh * D, H, bias=False)
        # the softplus gate: one value a head, one a head dimension, or none (gating false / "disabled": no g_proj)
        self.g_proj = None if gating == "none" else nn.Linear(H, nh if gating == "per-head" else nh * D, bias=False)
        self.q_norm = nn.Parameter(torch.ones(D))
        self.k_norm = nn.Parameter(torch.ones(D))
        self.gate_proj = nn.Linear(H, F_, bias=False)
        self.up_proj = nn.Linear(H, F_, bias=False)
        self.down_proj = nn.Linear(F_, H, bias=False)


class LagunaDFlash(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, D = cfg["hidden_size"], cfg["head_dim"]
        self.H, self.D = H, D
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.eps = cfg.get("rms_norm_eps", 1e-6)
        dc = cfg["dflash_config"]
        # vLLM's eagle_aux_hidden_state_layer_ids are the same taps plus one (export.py checks that they agree)
        self.taps = list(dc.get("target_layer_ids") or [e - 1 for e in cfg["eagle_aux_hidden_state_layer_ids"]])
        self.block = dc.get("block_size", 16)
        self.mask_id = dc.get("mask_token_id", 12)
        lt = cfg["layer_types"]
        # vLLM's rule: a top-level is_causal, then dflash_config's, else only sliding layers are causal
        flags = [v for v in (cfg.get("is_causal"), dc.get("is_causal"), dc.get("causal")) if v is not None]
        self.causal = bool(flags[0]) if flags else lt[0] == "sliding_attention"
        self.window = cfg["sliding_window"] if lt[0] == "sliding_attention" else None
        self.gating = {True: "per-head", False: "none", "disabled": "none"}.get(cfg.get("gating", True),
                                                                                  cfg.get("gating", True))
        self.per_head = self.gating == "per-head"
        rp = cfg.get("rope_parameters") or {}
        if any(isinstance(v, dict) for v in rp.values()):
            rp = rp.get(lt[0]) or rp.get("full_attention") or {}
        theta = rp.get("rope_theta", cfg.get("rope_theta", 500000.0))
        self.inv_freq = rope_inv_freq(theta, int(D * rp.get("partial_rotary_factor", 1.0)))
        n = len(self.taps)
        self.fc = nn.Linear(n * H, H, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(H))
        self.norm = nn.Parameter(torch.ones(H))
        self.aux_hidden_norms = nn.ParameterList([nn.Parameter(torch.ones(H)) for _ in range(n)])
        self.layers = nn.ModuleList([Layer(H, self.nh, self.nkv, D, cfg["intermediate_size"], self.gating)
                                     for _ in range(cfg["num_hidden_layers"])])

    # ---- context: per-tap norms, fc, hidden_norm ----
    def context(self, taps):
        """taps [T, n_taps, H] (target residual stream after each tap layer; the last one before the final norm)"""
        a = torch.stack([rms(taps[:, i], self.aux_hidden_norms[i], self.eps) for i in range(len(self.taps))], 1)
        return rms(self.fc(a.reshape(a.shape[0], -1)), self.hidden_norm, self.eps)

    def _kv(self, layer, u, pos):
        qkv = layer.qkv_proj(u)
        q_sz, kv_sz = self.nh * self.D, self.nkv * self.D
        k = qkv[:, q_sz:q_sz + kv_sz].view(-1, self.nkv, self.D)
        v = qkv[:, q_sz + kv_sz:].view(-1, self.nkv, self.D)
        k = apply_rope(rms(k, layer.k_norm, self.eps), pos, self.inv_freq)
        return k, v

    def draft_hidden(self, ctx, ctx_pos, tokens, P, embed):
        """ctx [C, H] at absolute positions ctx_pos [C] (all < P); tokens [B] at positions P..P+B-1."""
        B = tokens.numel()
        h = embed[tokens].float()
        qpos = torch.arange(P, P + B)
        for layer in self.layers:
            # context K/V: input_layernorm on the context before the K/V projection
            kc, vc = self._kv(layer, rms(ctx, layer.input_layernorm, self.eps), ctx_pos)
            x = rms(h, layer.input_layernorm, self.eps)
            qkv = layer.qkv_proj(x)
            q_sz = self.nh * self.D
            q = apply_rope(rms(qkv[:, :q_sz].view(B, self.nh, self.D), layer.q_norm, self.eps), qpos, self.inv_freq)
            kb, vb = self._kv(layer, x, qpos)
            K, V = torch.cat([kc, kb]), torch.cat([vc, vb])
            kpos = torch.cat([ctx_pos, qpos])
            is_block = torch.cat([torch.zeros(len(ctx_pos), dtype=torch.bool), torch.ones(B, dtype=torch.bool)])
            allowed = torch.ones(B, K.shape[0], dtype=torch.bool)
            if self.causal:
                allowed &= ~is_block[None, :] | (kpos[None, :] <= qpos[:, None])
            if self.window:
                allowed &= kpos[None, :] >= qpos[:, None] - (self.window - 1)
            g = self.nh // self.nkv
            Kx, Vx = K.repeat_interleave(g, 1), V.repeat_interleave(g, 1)      # [S, nh, D]
            s = torch.einsum("bhd,shd->hbs", q, Kx) / math.sqrt(self.D)
            s = s.masked_fill(~allowed[None], float("-inf"))
            o = torch.einsum("hbs,shd->bhd", torch.softmax(s.float(), -1), Vx)
            if layer.g_proj is not None:
                gate = F.softplus(layer.g_proj(x).float())
                o = o * gate[:, :, None] if self.per_head else o * gate.view(B, self.nh, self.D)
            h = h + layer.o_proj(o.reshape(B, -1))
            y = rms(h, layer.post_attention_layernorm, self.eps)
            h = h + layer.down_proj(F.silu(layer.gate_proj(y)) * layer.up_proj(y))
        return rms(h, self.norm, self.eps)

    def draft_logits(self, ctx, ctx_pos, bonus, P, block, embed, lm_head):
        tokens = torch.tensor([bonus] + [self.mask_id] * (block - 1))
        return self.draft_hidden(ctx, ctx_pos, tokens, P, embed)[1:] @ lm_head.float().T

    # ---- batched training forward (dev/tiny/train_drafter.py); same math as draft_hidden, many blocks at once ----
    def train_forward(self, ctx, anchors, tokens, embed, attn="sdpa"):
        """ctx [N, T, H]: fused context (self.context of the taps) of N sequences at positions 0..T-1.
        anchors [N, K]: block k of sequence n holds tokens[n, k] at positions anchors[n, k] + 0..B-1; a query at
        position p sees the context positions j < anchor and its own block's keys (only o' <= o if causal), all
        within the window (key position >= p - (W-1)), exactly as draft_hidden does for one block.
        tokens [N, K, B] (bonus, MASK, ...); embed [V, H]. Returns the normed hidden states [N, K, B, H]."""
        N, T, H = ctx.shape
        K, B = anchors.shape[1], tokens.shape[2]
        Q, dev = K * B, ctx.device
        inv_freq = self.inv_freq.to(dev)
        qpos = (anchors[:, :, None] + torch.arange(B, device=dev)).reshape(N, Q)           # [N, Q]
        cpos = torch.arange(T, device=dev)
        anc = anchors[:, :, None].expand(N, K, B).reshape(N, Q)
        allow_c = cpos[None, None, :] < anc[:, :, None]                                   # [N, Q, T]
        if self.window:
            allow_c &= cpos[None, None, :] >= qpos[:, :, None] - (self.window - 1)
        blk = torch.arange(Q, device=dev) // B
        off = torch.arange(Q, device=dev) % B
        allow_b = blk[:, None] == blk[None, :]                                            # [Q, Q]
        if self.causal:
            allow_b &= off[None, :] <= off[:, None]
        if self.window:
            allow_b &= off[None, :] >= off[:, None] - (self.window - 1)
        allowed = torch.cat([allow_c, allow_b[None].expand(N, Q, Q)], -1)[:, None]        # [N, 1, Q, T+Q]
        q_sz, kv_sz, g = self.nh * self.D, self.nkv * self.D, self.nh // self.nkv
        h = embed[tokens.reshape(N, Q)].float()
        for layer in self.layers:
            u = rms(ctx, layer.input_layernorm, self.eps)
            kvc = F.linear(u, layer.qkv_proj.weight[q_sz:])
            kc = apply_rope_nd(rms(kvc[..., :kv_sz].reshape(N, T, self.nkv, self.D), layer.k_norm, self.eps),
                               cpos[None].expand(N, T), inv_freq)
            vc = kvc[..., kv_sz:].reshape(N, T, self.nkv, self.D)
            x = rms(h, layer.input_layernorm, self.eps)
            qkv = layer.qkv_proj(x)
            q = apply_rope_nd(rms(qkv[..., :q_sz].reshape(N, Q, self.nh, self.D), layer.q_norm, self.eps), qpos,
                              inv_freq)
            kb = apply_rope_nd(rms(qkv[..., q_sz:q_sz + kv_sz].reshape(N, Q, self.nkv, self.D), layer.k_norm,
                                   self.eps), qpos, inv_freq)
            vb = qkv[..., q_sz + kv_sz:].reshape(N, Q, self.nkv, self.D)
            Kx = torch.cat([kc, kb], 1).repeat_interleave(g, 2).transpose(1, 2)            # [N, nh, S, D]
            Vx = torch.cat([vc, vb.to(vc.dtype)], 1).repeat_interleave(g, 2).transpose(1, 2)
            qx = q.transpose(1, 2)
            dt = Vx.dtype if torch.is_autocast_enabled() else torch.float32
            if attn == "sdpa":
                o = F.scaled_dot_product_attention(qx.to(dt), Kx.to(dt), Vx.to(dt), attn_mask=allowed)
            else:
                sc = (qx.float() @ Kx.float().transpose(-1, -2)) / math.sqrt(self.D)
                o = torch.softmax(sc.masked_fill(~allowed, float("-inf")), -1) @ Vx.float()
            o = o.transpose(1, 2)                                                          # [N, Q, nh, D]
            if layer.g_proj is not None:
                gate = F.softplus(layer.g_proj(x).float())
                o = o * gate[..., None] if self.per_head else o * gate.view(N, Q, self.nh, self.D)
            h = h + layer.o_proj(o.reshape(N, Q, -1))
            y = rms(h, layer.post_attention_layernorm, self.eps)
            h = h + layer.down_proj(F.silu(layer.gate_proj(y)) * layer.up_proj(y))
        return rms(h, self.norm, self.eps).reshape(N, K, B, H)

    def randomize(self, gen):
        """Random test weights (the fixtures' and dev/dflash_fuzz.py's): matrices N(0, 1 / fan_in), norms uniform in
        [0.5, 1.5) and the q / k norms in [0.8, 2.0)."""
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
                else:
                    lo, hi = (0.8, 2.0) if ("q_norm" in name or "k_norm" in name) else (0.5, 1.5)
                    p.copy_(torch.empty(p.shape).uniform_(lo, hi, generator=gen))
        return self

    # ---- checkpoint names as on disk (no "model." prefix) ----
    def state_for_disk(self):
        sd = {"fc.weight": self.fc.weight, "hidden_norm.weight": self.hidden_norm, "norm.weight": self.norm}
        for i, p in enumerate(self.aux_hidden_norms):
            sd[f"aux_hidden_norms.{i}.weight"] = p
        for l, L in enumerate(self.layers):
            p = f"layers.{l}."
            sd.update({p + "input_layernorm.weight": L.input_layernorm,
                       p + "post_attention_layernorm.weight": L.post_attention_layernorm,
                       p + "self_attn.qkv_proj.weight": L.qkv_proj.weight, p + "self_attn.o_proj.weight": L.o_proj.weight,
                       p + "self_attn.q_norm.weight": L.q_norm,
                       p + "self_attn.k_norm.weight": L.k_norm, p + "mlp.gate_proj.weight": L.gate_proj.weight,
                       p + "mlp.up_proj.weight": L.up_proj.weight, p + "mlp.down_proj.weight": L.down_proj.weight})
            if L.g_proj is not None:
                sd[p + "self_attn.g_proj.weight"] = L.g_proj.weight
        return {k: v.detach().contiguous() for k, v in sd.items()}


def target_taps(model, ids, layer_ids):
    """The target's residual stream after each layer in layer_ids (hooks on the decoder layers: the output
    of the last layer is taken before the final norm)."""
    got = {}
    hooks = [model.model.layers[t].register_forward_hook(
        lambda mod, inp, out, t=t: got.__setitem__(t, (out[0] if isinstance(out, tuple) else out).detach()))
        for t in layer_ids]
    with torch.no_grad():
        model(ids[None])
    for h in hooks:
        h.remove()
    return torch.stack([got[t][0] for t in layer_ids], 1)      # [T, n_taps, H]
