#!/usr/bin/env python3
"""Train the tiny Laguna target: transformers LagunaForCausalLM with every Laguna feature at small scale.

    python3 dev/tiny/train_target.py WORK [--smoke] [--deadline UNIX_TIME]

Reads WORK/tok/{train,val}.npy and the tokenizer; trains for config target.seconds of wall clock (or until
--deadline minus a reserve for the final eval and saving): random windows of the token stream, bf16 autocast on
the GPU, AdamW, linear warmup then cosine decay over the time budget, gradient clipping. The router's
e_score_correction_bias is trained the aux-loss-free way (raised for under-loaded experts, lowered for
over-loaded ones after every step). The held-out loss is measured every few seconds and the best weights are
kept. Saves WORK/target (save_pretrained in bf16 + tokenizer.json + tokenizer_config.json + chat_template.jinja +
generation_config.json) and WORK/logs/target_loss.csv, WORK/logs/target_summary.json.
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
import common  # noqa: E402
import config  # noqa: E402
from transformers import GenerationConfig, LagunaConfig, LagunaForCausalLM  # noqa: E402
from transformers.models.laguna.modeling_laguna import LagunaTopKRouter  # noqa: E402


def set_experts_impl(model, impl):
    try:
        model.set_experts_implementation(impl)
    except Exception:
        model.config._experts_implementation = impl


def count_params(model, cfg):
    total = sum(p.numel() for p in model.parameters())
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * k // E - model.model.embed_tokens.weight.numel()
    return total, active


@torch.no_grad()
def evaluate(model, val, starts, T, B, amp):
    model.eval()
    tot, n = 0.0, 0
    for i in range(0, len(starts), B):
        w = common.windows(val, starts[i:i + B], T + 1)
        with amp():
            logits = model(input_ids=w[:, :-1]).logits
        tot += F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                               reduction="sum").item()
        n += w[:, 1:].numel()
    model.train()
    return tot / max(1, n)


def main():
    a = config.stage_args(training=True)
    t_start = time.time()
    C = config.get(a.smoke)
    tc = C["target"]
    common.seed_all(C["seed"])
    dev, amp, amp_on = common.device_and_amp(a.amp)
    tok_dir = os.path.join(a.work, "tok")
    train = torch.from_numpy(np.load(os.path.join(tok_dir, "train.npy")).astype(np.int32)).to(dev)
    val = torch.from_numpy(np.load(os.path.join(tok_dir, "val.npy")).astype(np.int32)).to(dev)
    T, B = tc["seq_len"], tc["batch"]
    assert train.numel() > T + 1 and val.numel() > T + 1, "corpus too small"

    cfg = LagunaConfig(**tc["model"])
    model = LagunaForCausalLM(cfg).to(dev).float()
    model.train()
    total, active = count_params(model, cfg)
    print(f"target: {total / 1e6:.2f}M parameters ({active / 1e6:.2f}M active per token excl. embeddings), "
          f"bf16 file ~{2 * total / 1e6:.1f} MB; device {dev}, bf16 autocast {amp_on}; "
          f"train {train.numel() / 1e6:.2f}M tokens, val {val.numel() / 1e6:.3f}M")

    # router load, for the aux-loss-free correction-bias update
    routers = [m for m in model.modules() if isinstance(m, LagunaTopKRouter)]
    loads = {id(r): torch.zeros(cfg.num_experts, device=dev) for r in routers}

    def hook(mod, inp, out):
        sel = out[2]
        loads[id(mod)] += torch.bincount(sel.reshape(-1), minlength=cfg.num_experts).float()
    for r in routers:
        r.register_forward_hook(hook)

    g = torch.Generator(device=dev).manual_seed(C["seed"])

    def batch():
        s = torch.randint(0, train.numel() - T - 1, (B,), device=dev, generator=g)
        w = common.windows(train, s, T + 1)
        return w[:, :-1], w[:, 1:]

    def loss_of(x, y):
        with amp():
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))

    # pick the fastest MoE expert implementation that works here (timed fwd+bwd, no weight update)
    impls = tc["experts_impl"] if dev.type == "cuda" else ["eager"]
    best_impl, timings = None, {}
    for impl in impls:
        try:
            set_experts_impl(model, impl)
            for i in range(3):
                if i == 1:
                    common.sync(dev)
                    t0 = time.time()
                x, y = batch()
                loss = loss_of(x, y)
                loss.backward()
                if not torch.isfinite(loss):
                    raise RuntimeError("non-finite loss")
            common.sync(dev)
            timings[impl] = (time.time() - t0) / 2
            if best_impl is None or timings[impl] < timings[best_impl]:
                best_impl = impl
        except Exception as e:          # noqa: BLE001 - any failure: try the next implementation
            timings[impl] = f"failed: {type(e).__name__}: {str(e)[:200]}"
        model.zero_grad(set_to_none=True)
    if best_impl is None:
        raise SystemExit(f"no experts implementation works: {timings}")
    set_experts_impl(model, best_impl)
    for v in loads.values():
        v.zero_()
    print(f"experts implementation: {best_impl} (step times {timings})")
    g.manual_seed(C["seed"])

    opt = common.adamw(model.parameters(), tc["lr"], tc["betas"], tc["weight_decay"], dev)
    vg = torch.Generator(device=dev).manual_seed(C["seed"] + 7)
    n_eval = min(tc["eval_batches"] * B, max(1, (val.numel() - T - 1) // T))
    val_starts = torch.randint(0, val.numel() - T - 1, (n_eval,), device=dev, generator=vg)
    logs = os.path.join(a.work, "logs")
    log = common.CsvLog(os.path.join(logs, "target_loss.csv"),
                        ["step", "time_s", "tokens", "lr", "train_loss", "val_loss", "load_max_over_mean"])
    # the loop ends early enough to leave time for the final eval and saving
    clock = common.Clock(tc["seconds"], a.deadline or None, reserve=25 if not a.smoke else 10)
    step, tokens, acc, acc_n = 0, 0, 0.0, 0
    best = (float("inf"), None, -1)
    last_eval = time.time()
    imb = float("nan")
    while True:
        done = clock.done()
        if done or time.time() - last_eval >= tc["eval_every_s"]:
            vl = evaluate(model, val, val_starts, T, B, amp)
            if vl < best[0]:
                best = (vl, {k: v.detach().clone() for k, v in model.state_dict().items()}, step)
            tl = acc / acc_n if acc_n else float("nan")
            log.row(step=step, time_s=clock.elapsed(), tokens=tokens, lr=opt.param_groups[0]["lr"],
                    train_loss=tl if acc_n else None, val_loss=vl, load_max_over_mean=imb)
            print(f"  step {step:6d}  {clock.elapsed():6.1f} s  {tokens / 1e6:7.2f}M tok  "
                  f"{tokens / max(1e-9, clock.elapsed()) / 1e3:6.1f}K tok/s  train {tl:.4f}  val {vl:.4f}  "
                  f"load max/mean {imb:.2f}", flush=True)
            acc, acc_n = 0.0, 0
            last_eval = time.time()
        if done:
            break
        lr = common.lr_at(step, clock.frac(), tc["lr"], tc["warmup_steps"], tc["min_lr_frac"])
        for pg in opt.param_groups:
            pg["lr"] = lr
        x, y = batch()
        loss = loss_of(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc["grad_clip"])
        opt.step()
        with torch.no_grad():                   # aux-loss-free balancing
            ratios = []
            for r in routers:
                ld = loads[id(r)]
                r.e_score_correction_bias.add_(tc["bias_update"] * torch.sign(ld.mean() - ld))
                ratios.append(ld.max() / ld.mean().clamp_min(1))
                ld.zero_()
            if step % 50 == 0:
                imb = float(torch.stack(ratios).max())
        step += 1
        tokens += B * T
        if step % 10 == 0:
            acc += loss.item()
            acc_n += 1
    train_s = clock.elapsed()
    model.load_state_dict(best[1])
    print(f"best val loss {best[0]:.4f} at step {best[2]} of {step} ({tokens / 1e6:.1f}M tokens, "
          f"{tokens / train_s / 1e3:.1f}K tok/s)")

    out = os.path.join(a.work, "target")
    if os.path.exists(out):
        shutil.rmtree(out)
    model = model.to(torch.bfloat16)
    model.config._experts_implementation = None
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=2, eos_token_id=[2, 24], pad_token_id=9, do_sample=True, temperature=0.6,
                     top_p=0.95).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(os.path.join(tok_dir, f), out)
    summary = {"parameters": total, "active_parameters_excl_embed": active, "steps": step, "tokens": tokens,
               "train_seconds": round(train_s, 1), "tokens_per_s": round(tokens / train_s),
               "best_val_loss": best[0], "best_step": best[2], "experts_impl": best_impl,
               "experts_impl_timings": timings, "device": str(dev) if dev.type == "cpu" else
               torch.cuda.get_device_name(0), "bf16_autocast": amp_on, "seconds_total": round(time.time() - t_start, 1)}
    with open(os.path.join(logs, "target_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"saved {out} ({sum(os.path.getsize(os.path.join(out, x)) for x in os.listdir(out)) / 1e6:.1f} MB); "
          f"{summary['seconds_total']} s in all")


if __name__ == "__main__":
    main()
