#!/usr/bin/env python3
"""Train the DFlash drafter of the tiny Laguna on the frozen trained target.

    python3 dev/tiny/train_drafter.py WORK [--smoke] [--deadline UNIX_TIME]

The drafter is LagunaDFlash of dev/dflash_ref.py (names as on disk: export.py converts it). Recipe:
  - training sequences: random windows of the corpus stream, and (a fraction config drafter.gen_mix of the
    batches) the target's own greedy continuations of corpus prompts, generated first for gen_seconds;
  - the frozen target runs on each batch: its taps (residual stream after the target_layer_ids layers, the last
    one before the final norm, as dflash_ref.target_taps) and its greedy token at every position;
  - K random anchor positions per sequence; block = [x_anchor, MASK x (B-1)] at positions anchor..anchor+B-1;
    context = fused taps of positions < anchor inside the sliding window; causal inside the block;
  - loss: cross-entropy of block slots 1..B-1 against the target's greedy token at anchor+o (labels="target";
    "data" uses the corpus token), slot o weighted exp(-(o-1)/gamma); the target's embedding and lm_head are
    shared and frozen.
Measures on held-out windows the per-slot agreement with the target and the implied mean accepted length
tau = 1 + E[length of the matching prefix]. Saves WORK/drafter (config.json + model.safetensors, bf16) and
WORK/logs/drafter_loss.csv, WORK/logs/drafter_summary.json.
"""
import json
import os
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402
import config  # noqa: E402
from dflash_ref import LagunaDFlash  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LagunaForCausalLM  # noqa: E402


class Target:
    """The frozen target with forward hooks on the tap layers."""

    def __init__(self, path, layer_ids, dev, amp, impl):
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        self.model = LagunaForCausalLM.from_pretrained(path, dtype=dtype).to(dev).eval()
        self.model.requires_grad_(False)
        self.amp, self.layer_ids, self.got = amp, layer_ids, {}
        self.impl = impl
        try:
            self.model.set_experts_implementation(impl)
        except Exception:
            self.model.config._experts_implementation = impl
        for t in layer_ids:
            self.model.model.layers[t].register_forward_hook(
                lambda mod, inp, out, t=t: self.got.__setitem__(t, out[0] if isinstance(out, tuple) else out))

    @torch.no_grad()
    def run(self, x):
        """x [N, T] -> taps [N, T, n_taps, H] (fp32), greedy next token per position [N, T]"""
        self.got.clear()
        with self.amp():
            logits = self.model(input_ids=x).logits
        taps = torch.stack([self.got[t] for t in self.layer_ids], 2).float()
        self.got.clear()
        return taps, logits.argmax(-1)

    @torch.no_grad()
    def generate(self, prompts, n_new, stop_at):
        """Greedy continuations with the KV cache; None if time.time() passes stop_at first."""
        with self.amp():
            out = self.model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        seq = [prompts, nxt[:, None]]
        for _ in range(n_new - 1):
            if time.time() > stop_at:
                return None
            with self.amp():
                out = self.model(input_ids=nxt[:, None], past_key_values=pkv, use_cache=True, logits_to_keep=1)
            pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
            seq.append(nxt[:, None])
        return torch.cat(seq, 1)


def make_blocks(x, pred, K, B, mask_id, labels, gen):
    """Random anchors [N, K] in 1..T-B, block tokens [N, K, B] and labels [N, K, B-1]."""
    N, T = x.shape
    anchors = torch.rand(N, T - B, device=x.device, generator=gen).argsort(1)[:, :K] + 1
    tokens = torch.full((N, K, B), mask_id, device=x.device, dtype=torch.long)
    tokens[:, :, 0] = x.gather(1, anchors)
    pos = anchors[:, :, None] + torch.arange(1, B, device=x.device)                 # positions anchor+1..
    if labels == "target":                     # the target's greedy token at anchor+o comes from row anchor+o-1
        lab = pred.gather(1, (pos - 1).reshape(N, -1)).reshape(N, K, B - 1)
    else:
        lab = x.gather(1, pos.reshape(N, -1)).reshape(N, K, B - 1)
    return anchors, tokens, lab


def main():
    a = config.stage_args(training=True)
    t_start = time.time()
    C = config.get(a.smoke)
    dc = C["drafter"]
    mc = dict(dc["model"])
    common.seed_all(C["seed"] + 100)
    dev, amp, amp_on = common.device_and_amp(a.amp)
    tok_dir = os.path.join(a.work, "tok")
    train = torch.from_numpy(np.load(os.path.join(tok_dir, "train.npy")).astype(np.int32)).to(dev)
    val = torch.from_numpy(np.load(os.path.join(tok_dir, "val.npy")).astype(np.int32)).to(dev)
    T, N, K = dc["seq_len"], dc["batch"], dc["anchors"]
    B, mask_id = mc["dflash_config"]["block_size"], mc["dflash_config"]["mask_token_id"]
    layer_ids = mc["dflash_config"]["target_layer_ids"]
    try:
        impl = json.load(open(os.path.join(a.work, "logs", "target_summary.json")))["experts_impl"]
    except Exception:
        impl = "eager"
    if dev.type != "cuda":
        impl = "eager"
    tgt_dir = os.path.join(a.work, "target")
    target = Target(tgt_dir, layer_ids, dev, amp, impl)
    tcfg = target.model.config
    assert tcfg.hidden_size == mc["hidden_size"] and tcfg.vocab_size == mc["vocab_size"]
    assert mc["dflash_config"]["num_target_layers"] == tcfg.num_hidden_layers
    embed = target.model.model.embed_tokens.weight.detach()
    lm_head = target.model.lm_head.weight.detach()
    try:
        target.run(train[None, :T].long())
    except Exception as e:                      # noqa: BLE001
        print(f"experts implementation {impl} failed ({type(e).__name__}: {e}); using eager")
        target = Target(tgt_dir, layer_ids, dev, amp, "eager")

    g = torch.Generator(device=dev).manual_seed(C["seed"] + 101)

    # 1) the target's own greedy continuations of corpus prompts (what the drafter faces at inference): a small
    #    held-out set from the val stream first, then training sequences while the time lasts
    Lp, gen_s0 = dc["gen_prompt"], time.time()
    n_val_gen = dc["gen_val"]
    gen_end = time.time() + dc["gen_seconds"]
    if a.deadline:
        gen_end = min(gen_end, a.deadline - dc["seconds"] - 20)

    def gen_batch(stream, n, length, stop_at):
        s = torch.randint(0, stream.numel() - Lp, (n,), device=dev, generator=g)
        return target.generate(common.windows(stream, s, Lp), length - Lp, stop_at)

    pool, val_gen = [], None
    if dc["gen_mix"] > 0:
        try:
            val_gen = gen_batch(val, n_val_gen, T, gen_end + dc["gen_seconds"])
            while True:
                t0 = time.time()
                stop = max(gen_end, t0 + 1) if pool else t0 + 1.5 * dc["gen_seconds"]   # the first may overrun
                if a.deadline:
                    stop = min(stop, a.deadline - dc["seconds"] - 10)
                seq = gen_batch(train, dc["gen_batch"], T, stop)
                if seq is None:
                    break
                pool.append(seq.to(torch.int32))
                if time.time() + 1.1 * (time.time() - t0) > gen_end:
                    break
        except Exception as e:                  # noqa: BLE001 - train on corpus windows only
            print(f"generation failed ({type(e).__name__}: {e}); training on corpus windows only")
    pool = torch.cat(pool) if pool else None
    n_gen = 0 if pool is None else pool.shape[0]
    print(f"generated {n_gen} + {0 if val_gen is None else val_gen.shape[0]} (held-out) greedy sequences of {T} "
          f"tokens from {Lp}-token corpus prompts in {time.time() - gen_s0:.1f} s")
    if n_gen:
        print(f"  e.g. continuation ids {pool[0, Lp:Lp + 40].tolist()}")

    drafter = LagunaDFlash(mc).to(dev)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {n_params / 1e6:.2f}M parameters, {mc['num_hidden_layers']} layers, taps {layer_ids}, "
          f"block {B}, window {mc['sliding_window']}; batch {N} x {T} with {K} blocks each; device {dev}, "
          f"bf16 autocast {amp_on}")
    w = torch.exp(-torch.arange(B - 1, device=dev, dtype=torch.float32) / dc["loss_gamma"])
    w = w / w.sum()

    def step_loss(x, gen_, labels):
        taps, pred = target.run(x)
        anchors, tokens, lab = make_blocks(x, pred, K, B, mask_id, labels, gen_)
        with amp():
            ctx = drafter.context(taps.reshape(-1, len(layer_ids), taps.shape[-1])).reshape(x.shape[0], T, -1)
            hid = drafter.train_forward(ctx, anchors, tokens, embed)
            logits = F.linear(hid[:, :, 1:], lm_head)                                   # [N, K, B-1, V]
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), lab.reshape(-1),
                             reduction="none").reshape(lab.shape)
        return (ce * w).sum(-1).mean(), (logits.argmax(-1) == lab)

    vg = torch.Generator(device=dev).manual_seed(C["seed"] + 102)
    val_sets = {"data": [common.windows(val, torch.randint(0, val.numel() - T, (N,), device=dev, generator=vg), T)
                         for _ in range(dc["eval_batches"])]}
    if val_gen is not None:
        val_sets["gen"] = [val_gen[i:i + N].long() for i in range(0, val_gen.shape[0], N)]

    @torch.no_grad()
    def evaluate():
        """held-out loss, and per-slot agreement with the target / implied tau on each held-out set"""
        drafter.eval()
        res = {}
        for name, batches in val_sets.items():
            eg = torch.Generator(device=dev).manual_seed(C["seed"] + 103)
            tot, match = 0.0, []
            for x in batches:
                loss, m = step_loss(x, eg, "target")
                tot += loss.item()
                match.append(m.reshape(-1, B - 1).float())
            m = torch.cat(match)
            res[name] = (tot / len(batches), m.mean(0).tolist(), 1.0 + m.cumprod(1).sum(1).mean().item())
        drafter.train()
        return res

    opt = common.adamw(drafter.parameters(), dc["lr"], dc["betas"], dc["weight_decay"], dev)
    log = common.CsvLog(os.path.join(a.work, "logs", "drafter_loss.csv"),
                        ["step", "time_s", "blocks", "lr", "train_loss", "val_loss", "val_tau", "valgen_loss",
                         "valgen_tau"] + [f"valgen_acc_{o}" for o in range(1, B)] +
                        [f"val_acc_{o}" for o in range(1, B)])
    clock = common.Clock(dc["seconds"], a.deadline or None, reserve=15 if not a.smoke else 8)
    step, blocks, acc, acc_n, last_eval = 0, 0, 0.0, 0, time.time()
    best = (-1.0, None, -1, None, None)
    while True:
        done = clock.done()
        if done or time.time() - last_eval >= dc["eval_every_s"]:
            ev = evaluate()
            vl, per, tau = ev["data"]
            gl, gper, gtau = ev.get("gen", (None, per, tau))
            if gtau > best[0]:                  # keep the drafter that agrees best on held-out greedy outputs
                best = (gtau, {k: v.detach().clone() for k, v in drafter.state_dict().items()}, step, gper, tau)
            tl = acc / acc_n if acc_n else None
            log.row(step=step, time_s=clock.elapsed(), blocks=blocks, lr=opt.param_groups[0]["lr"], train_loss=tl,
                    val_loss=vl, val_tau=tau, valgen_loss=gl, valgen_tau=gtau if "gen" in ev else None,
                    **{f"val_acc_{o}": per[o - 1] for o in range(1, B)},
                    **({f"valgen_acc_{o}": gper[o - 1] for o in range(1, B)} if "gen" in ev else {}))
            print(f"  step {step:6d}  {clock.elapsed():6.1f} s  {blocks / 1e3:8.1f}K blocks  train "
                  f"{float('nan') if tl is None else tl:.4f}  held-out: corpus loss {vl:.4f} tau {tau:.3f} | greedy "
                  f"tau {gtau:.3f}, per slot {' '.join(f'{p:.2f}' for p in gper[:8])} ...", flush=True)
            acc, acc_n, last_eval = 0.0, 0, time.time()
        if done:
            break
        lr = common.lr_at(step, clock.frac(), dc["lr"], dc["warmup_steps"], dc["min_lr_frac"])
        for pg in opt.param_groups:
            pg["lr"] = lr
        if n_gen and torch.rand((), generator=g, device=dev).item() < dc["gen_mix"]:
            x = pool[torch.randint(0, n_gen, (N,), device=dev, generator=g)].long()
        else:
            x = common.windows(train, torch.randint(0, train.numel() - T, (N,), device=dev, generator=g), T)
        loss, _ = step_loss(x, g, dc["labels"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), dc["grad_clip"])
        opt.step()
        step += 1
        blocks += N * K
        if step % 5 == 0:
            acc += loss.item()
            acc_n += 1
    drafter.load_state_dict(best[1])
    print(f"best held-out tau {best[0]:.3f} on greedy continuations ({best[4]:.3f} on corpus windows) at step "
          f"{best[2]} of {step} ({blocks / 1e6:.2f}M blocks)")

    out = os.path.join(a.work, "drafter")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    # matrices in bf16; norm vectors in f32 (export.py keeps them as they are; it would not recognise
    # aux_hidden_norms.N.weight as a norm and leave it bf16, which laguna refuses)
    save_file({k: (v.to(torch.bfloat16) if v.dim() >= 2 else v.float()).cpu().contiguous()
               for k, v in drafter.state_for_disk().items()},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(mc, torch_dtype="bfloat16"), f, indent=1)
    summary = {"parameters": n_params, "steps": step, "blocks": blocks, "train_seconds": round(clock.elapsed(), 1),
               "generated_sequences": n_gen, "best_val_tau": best[0], "best_val_tau_corpus": best[4],
               "best_step": best[2], "best_val_acc_per_slot": best[3], "labels": dc["labels"], "experts_impl": target.impl,
               "seconds_total": round(time.time() - t_start, 1)}
    with open(os.path.join(a.work, "logs", "drafter_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"saved {out} ({os.path.getsize(os.path.join(out, 'model.safetensors')) / 1e6:.1f} MB); "
          f"{summary['seconds_total']} s in all")


if __name__ == "__main__":
    main()
