#!/usr/bin/env python3
"""Train the DFlash drafter of the tiny Laguna on the frozen trained target.

    python3 dev/tiny/train_drafter.py WORK [--smoke] [--deadline UNIX_TIME]

Reads WORK/corpus/docs.jsonl (corpus.py) and the target's HF dir WORK/target (with its tokenizer.json). The drafter
is LagunaDFlash of dev/dflash_ref.py (names as on disk: export.py converts it).

The drafter is trained where it is used. The speculative loop drafts only inside the target's own greedy output,
after a prompt, and the evaluation (dev/tiny/eval.py) prompts with code cut from held-out files (up to 16 lines
ending with a def line, train_tokenizer.code_prompts) and generates 128 greedy tokens. So:
  - data: code prompts cut the same way from the train split's files (BOS + text, at most gen_prompt_max tokens),
    and the target's greedy continuation of gen_new tokens, for gen_seconds. Prompts of one batch have one
    length: sorted by length, each batch cut to its shortest by dropping the tokens after BOS;
  - one target pass over each whole sequence gives its taps (residual stream after the target_layer_ids layers,
    the last before the final norm, as dflash_ref.target_taps) and its greedy token at every position; both stay
    on the device (bf16 / int32), so the target never runs during training;
  - training: K anchors per sequence among the continuation positions (the loop's bonus tokens are generated
    tokens); block = [x_anchor, MASK x (B-1)] at anchor..anchor+B-1; context = fused taps of the positions
    < anchor inside the window; causal in the block; cross-entropy of slots 1..B-1 against the target's greedy
    token at anchor+o, slot o weighted exp(-(o-1)/gamma); the target's embedding and lm_head are shared, frozen;
  - metric: the held-out set is built the same way from the val split's files (minus those of WORK/heldout.json,
    the CI held-out set eval.py prompts from). Every continuation position is an anchor (one teacher-forced
    pass) and dflash_metric.chain walks the loop over them: tau = 1 + accepted / steps over eval_n tokens, the
    acceptance rule and per-position rates of laguna itself (not the mean over uniform anchors, which
    overestimates tau: see dflash_metric.py). The drafter with the best held-out tau is saved.
Saves WORK/drafter (config.json + model.safetensors, bf16), WORK/logs/drafter_loss.csv and drafter_summary.json.
"""
import json
import os
import random
import shutil
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import common  # noqa: E402
import config  # noqa: E402
import dflash_metric  # noqa: E402
from dflash_ref import LagunaDFlash  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from train_tokenizer import BOS, code_prompts  # noqa: E402
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
        """x [N, T] -> taps [N, T, n_taps, H] (bf16), greedy next token per position [N, T] (int32)"""
        self.got.clear()
        with self.amp():
            logits = self.model(input_ids=x).logits
        taps = torch.stack([self.got[t] for t in self.layer_ids], 2).to(torch.bfloat16)
        self.got.clear()
        return taps, logits.argmax(-1).to(torch.int32)

    @torch.no_grad()
    def generate(self, prompts, n_new):
        """Greedy continuations [N, T + n_new] with the KV cache."""
        with self.amp():
            out = self.model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        seq = [prompts, nxt[:, None]]
        for _ in range(n_new - 1):
            with self.amp():
                out = self.model(input_ids=nxt[:, None], past_key_values=pkv, use_cache=True, logits_to_keep=1)
            pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
            seq.append(nxt[:, None])
        return torch.cat(seq, 1)


# ---- data: code prompts, the target's greedy continuations, its taps ----

def prompt_texts(docs, n_max, per_file, rng):
    """Up to n_max code prompts, at most per_file random ones from each file, files in random order."""
    docs = list(docs)
    rng.shuffle(docs)
    out = []
    for d in docs:
        spots = code_prompts(d["text"])
        rng.shuffle(spots)
        out.extend(t for _, t in spots[:per_file])
        if len(out) >= n_max:
            break
    return out[:n_max]


def length_batches(tok, prompts, lo, hi, batch, rng):
    """prompts [(text, is_held_out)] -> token prompts (BOS + ids, at most hi tokens: the end of a longer prompt
    is kept) in batches of one length: sorted by length, cut into batches, each prompt cut to the batch's
    shortest by dropping the tokens after BOS. Prompts shorter than lo are left out. Returns
    [(LongTensor [n, L], BoolTensor [n] held-out)] in random order."""
    enc = tok.encode_batch([t for t, _ in prompts], add_special_tokens=False)
    ids = sorted(((e.ids[-(hi - 1):], v) for e, (_, v) in zip(enc, prompts) if len(e.ids) + 1 >= lo),
                 key=lambda x: len(x[0]))
    out = []
    for k in range(0, len(ids), batch):
        grp = ids[k:k + batch]
        L = len(grp[0][0])
        out.append((torch.tensor([[BOS] + x[len(x) - L:] for x, _ in grp]), torch.tensor([v for _, v in grp])))
    rng.shuffle(out)
    return out


class Seqs:
    """Generated sequences of one prompt length: tokens [n, T], taps [n, T, n_taps, H] bf16, the target's greedy
    token after each position [n, T], and the prompt length (the position of the first generated token)."""

    def __init__(self, seq, taps, pred, prompt_len):
        self.seq, self.taps, self.pred, self.prompt_len = seq, taps, pred, prompt_len

    def rows(self):
        return self.seq.shape[0]

    def select(self, m):
        return Seqs(self.seq[m], self.taps[m], self.pred[m], self.prompt_len)


def generate_all(target, batches, n_new, stop_at, chunk, dev):
    """Generate and capture taps batch by batch (the first always; the others while they end before stop_at).
    Returns the training and the held-out Seqs."""
    train, val, t_batch = [], [], None
    for x, held_out in batches:
        if t_batch is not None and time.time() + 1.1 * t_batch > stop_at:
            break
        t0 = time.time()
        for s, m in _generate(target, x.to(dev), held_out.to(dev), n_new, chunk):
            if (~m).any():
                train.append(s.select(~m))
            if m.any():
                val.append(s.select(m))
        t_batch = time.time() - t0
    return train, val


def _generate(target, x, held_out, n_new, chunk):
    """[(Seqs, held-out mask)] for the prompts x; split in two if the batch does not fit in memory."""
    try:
        seq = target.generate(x, n_new)
        taps, pred = zip(*(target.run(seq[i:i + chunk]) for i in range(0, seq.shape[0], chunk)))
        return [(Seqs(seq.to(torch.int32), torch.cat(taps), torch.cat(pred), x.shape[1]), held_out)]
    except torch.cuda.OutOfMemoryError:
        if x.shape[0] < 2:
            raise
        torch.cuda.empty_cache()
        h = x.shape[0] // 2
        print(f"  out of memory generating {x.shape[0]} sequences: two batches of {h} and {x.shape[0] - h}")
        return (_generate(target, x[:h], held_out[:h], n_new, chunk) +
                _generate(target, x[h:], held_out[h:], n_new, chunk))


def main():
    a = config.stage_args(training=True)
    t_start = time.time()
    C = config.get(a.smoke)
    dc = C["drafter"]
    mc = dict(dc["model"])
    common.seed_all(C["seed"] + 100)
    dev, amp, amp_on = common.device_and_amp(a.amp)
    N, K = dc["batch"], dc["anchors"]
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
        target.run(torch.full((1, 16), BOS, device=dev))
    except Exception as e:                      # noqa: BLE001
        print(f"experts implementation {impl} failed ({type(e).__name__}: {e}); using eager")
        target = Target(tgt_dir, layer_ids, dev, amp, "eager")

    # 1) code prompts from the corpus files, tokenized with the target's tokenizer
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(tgt_dir, "tokenizer.json"))
    exclude = set()                             # the files eval.py prompts from stay out of the metric set
    if os.path.exists(os.path.join(a.work, "heldout.json")):
        exclude = {f["key"] for f in json.load(open(os.path.join(a.work, "heldout.json"), encoding="utf-8"))["files"]}
    docs = {"train": [], "val": []}
    with open(os.path.join(a.work, "corpus", "docs.jsonl"), encoding="utf-8") as f:
        for line in f:
            d = json.loads(line)
            if d["key"] not in exclude:
                docs[d["split"]].append(d)
    docs["train"].sort(key=lambda d: d["key"])
    docs["val"].sort(key=lambda d: d["key"])
    rng = random.Random(C["seed"] + 104)
    prompts = ([(t, True) for t in prompt_texts(docs["val"], dc["gen_val"], dc["prompts_per_file"], rng)] +
               [(t, False) for t in prompt_texts(docs["train"], dc["gen_max_prompts"], dc["prompts_per_file"], rng)])
    batches = length_batches(tok, prompts, dc["gen_prompt_min"], dc["gen_prompt_max"], dc["gen_batch"], rng)
    del docs, prompts
    print(f"prompts: {sum(len(v) for _, v in batches)} in {len(batches)} batches of one length, "
          f"{sum(int(v.sum()) for _, v in batches)} of them held-out (val split; {len(exclude)} files of the CI "
          f"held-out set excluded); {time.time() - t_start:.1f} s")

    # 2) the target's greedy continuations and taps (held-out prompts ride along in the same batches)
    n_new = dc["gen_new"]
    gen_end = time.time() + dc["gen_seconds"]
    if a.deadline:
        gen_end = min(gen_end, a.deadline - dc["min_train_seconds"] - 20)
    g0 = time.time()
    pool, val = generate_all(target, batches, n_new, gen_end, dc["tap_chunk"], dev)
    n_gen = sum(s.rows() for s in pool)
    n_tok = sum(s.rows() * s.seq.shape[1] for s in pool)
    print(f"generated {n_gen} + {sum(s.rows() for s in val)} (held-out) greedy continuations of {n_new} tokens "
          f"after prompts of {min(s.prompt_len for s in pool)}..{max(s.prompt_len for s in pool)} tokens, with their "
          f"taps ({n_tok / 1e6:.1f}M positions, {sum(s.taps.numel() * 2 for s in pool) / 1e9:.1f} GB), in "
          f"{time.time() - g0:.1f} s")
    print(f"  e.g. continuation ids {pool[0].seq[0, pool[0].prompt_len:pool[0].prompt_len + 40].tolist()}")
    del target.model
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    drafter = LagunaDFlash(mc).to(dev)
    g = torch.Generator(device=dev).manual_seed(C["seed"] + 101)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(f"drafter: {n_params / 1e6:.2f}M parameters, {mc['num_hidden_layers']} layers, taps {layer_ids}, "
          f"block {B}, window {mc['sliding_window']}; batch {N} sequences with {K} blocks each; device {dev}, "
          f"bf16 autocast {amp_on}")
    w = torch.exp(-torch.arange(B - 1, device=dev, dtype=torch.float32) / dc["loss_gamma"])
    w = w / w.sum()
    n_taps, H = len(layer_ids), mc["hidden_size"]

    def fused_context(s, rows):
        taps = s.taps[rows]
        return drafter.context(taps.reshape(-1, n_taps, H).float()).reshape(taps.shape[0], taps.shape[1], H)

    def step_loss(s, rows, gen_):
        """Loss on K random continuation anchors of each row (anchor + B-1 <= T-1: every slot has a label)."""
        x, pred = s.seq[rows].long(), s.pred[rows].long()
        n, T = x.shape
        choices = T - B - s.prompt_len + 1
        anchors = torch.rand(n, choices, device=dev, generator=gen_).argsort(1)[:, :K] + s.prompt_len
        k = anchors.shape[1]
        tokens = torch.full((n, k, B), mask_id, device=dev, dtype=torch.long)
        tokens[:, :, 0] = x.gather(1, anchors)
        pos = anchors[:, :, None] + torch.arange(0, B - 1, device=dev)        # row anchor+o-1 predicts anchor+o
        lab = pred.gather(1, pos.reshape(n, -1)).reshape(n, k, B - 1)
        with amp():
            hid = drafter.train_forward(fused_context(s, rows), anchors, tokens, embed)
            logits = F.linear(hid[:, :, 1:], lm_head)                           # [n, k, B-1, V]
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), lab.reshape(-1),
                             reduction="none").reshape(lab.shape)
        return (ce * w).sum(-1).mean()

    eval_n = min(dc["eval_n"], n_new)

    @torch.no_grad()
    def evaluate():
        """held-out loss, and the loop's tau over eval_n tokens of every held-out continuation"""
        drafter.eval()
        eg = torch.Generator(device=dev).manual_seed(C["seed"] + 103)
        loss, nl, steps, acc, at, Lsum, Ln = 0.0, 0, 0, 0, [0] * (B - 1), 0, 0
        for s in val:
            for r0 in range(0, s.rows(), dc["eval_rows"]):
                rows = torch.arange(r0, min(s.rows(), r0 + dc["eval_rows"]), device=dev)
                loss += step_loss(s, rows, eg).item() * rows.numel()
                nl += rows.numel()
                anchors = torch.arange(s.prompt_len, s.prompt_len + eval_n, device=dev).expand(rows.numel(), -1)
                L = dflash_metric.block_lengths(drafter, fused_context(s, rows), s.seq[rows].long(),
                                                s.pred[rows].long(), anchors, embed, lm_head, amp)
                for row in L.cpu():
                    st, ac, at_ = dflash_metric.chain(row, eval_n, B)
                    steps, acc = steps + st, acc + ac
                    at = [x + y for x, y in zip(at, at_)]
                Lsum, Ln = Lsum + L.sum().item(), Ln + L.numel()
        drafter.train()
        S = max(1, steps)
        return loss / max(1, nl), 1 + acc / S, [x / S for x in at], Lsum / max(1, Ln)

    opt = common.adamw(drafter.parameters(), dc["lr"], dc["betas"], dc["weight_decay"], dev)
    log = common.CsvLog(os.path.join(a.work, "logs", "drafter_loss.csv"),
                        ["step", "time_s", "blocks", "lr", "train_loss", "val_loss", "val_tau", "val_tau_uniform"] +
                        [f"val_pos_{o}" for o in range(1, B)])
    clock = common.Clock(dc["seconds"], a.deadline or None, reserve=15 if not a.smoke else 8)
    pick = random.Random(C["seed"] + 105)
    sizes = [s.rows() for s in pool]
    step, blocks, acc_loss, acc_n, last_eval = 0, 0, 0.0, 0, time.time()
    best = (-1.0, None, -1, None, None)
    while True:
        done = clock.done()
        if done or time.time() - last_eval >= dc["eval_every_s"]:
            vl, tau, per, tau_u = evaluate()
            if tau > best[0]:                   # keep the drafter with the best held-out tau
                best = (tau, {k: v.detach().clone() for k, v in drafter.state_dict().items()}, step, per, tau_u)
            tl = acc_loss / acc_n if acc_n else None
            log.row(step=step, time_s=clock.elapsed(), blocks=blocks, lr=opt.param_groups[0]["lr"], train_loss=tl,
                    val_loss=vl, val_tau=tau, val_tau_uniform=tau_u, **{f"val_pos_{o}": per[o - 1] for o in range(1, B)})
            print(f"  step {step:6d}  {clock.elapsed():6.1f} s  {blocks / 1e6:7.2f}M blocks  train "
                  f"{float('nan') if tl is None else tl:.4f}  held-out: loss {vl:.4f}  tau {tau:.3f} (mean L over "
                  f"anchors {tau_u:.2f}); per position {' '.join(f'{p:.2f}' for p in per[:8])} ...", flush=True)
            acc_loss, acc_n, last_eval = 0.0, 0, time.time()
        if done:
            break
        lr = common.lr_at(step, clock.frac(), dc["lr"], dc["warmup_steps"], dc["min_lr_frac"])
        for pg in opt.param_groups:
            pg["lr"] = lr
        s = pick.choices(pool, weights=sizes)[0]         # a batch of one prompt length, by its size
        rows = torch.randint(0, s.rows(), (N,), device=dev, generator=g)
        loss = step_loss(s, rows, g)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), dc["grad_clip"])
        opt.step()
        step += 1
        blocks += N * K
        if step % 5 == 0:
            acc_loss += loss.item()
            acc_n += 1
    drafter.load_state_dict(best[1])
    print(f"best held-out tau {best[0]:.3f} (the loop's, over {eval_n} tokens of {sum(s.rows() for s in val)} "
          f"held-out prompts; mean L over anchors {best[4]:.3f}) at step {best[2]} of {step} ({blocks / 1e6:.2f}M "
          f"blocks); per position " + " ".join(f"{p:.2f}" for p in best[3]))

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
               "generated_sequences": n_gen, "generated_positions": n_tok, "heldout_sequences": sum(s.rows() for s in val),
               "eval_n": eval_n, "best_val_tau": best[0], "best_val_tau_uniform_anchors": best[4],
               "best_step": best[2], "best_val_acc_per_position": best[3], "experts_impl": target.impl,
               "seconds_total": round(time.time() - t_start, 1)}
    with open(os.path.join(a.work, "logs", "drafter_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"saved {out} ({os.path.getsize(os.path.join(out, 'model.safetensors')) / 1e6:.1f} MB); "
          f"{summary['seconds_total']} s in all")


if __name__ == "__main__":
    main()
