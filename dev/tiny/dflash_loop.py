#!/usr/bin/env python3
"""The DFlash speculative loop in PyTorch, on the tiny target and its drafter, to cross-check the C program's tau
and the training-time estimate of it.

    python3 dev/tiny/dflash_loop.py [--target models/src/tiny] [--drafter models/src/tiny-dflash]
                                    [--heldout models/src/tiny-train/heldout.json] [--prompts 24] [--n 128]
                                    [--synthetic 0] [--out loop.json]

1. The real loop, exactly as laguna.c's generate_dflash runs it with `--raw -t 0 -n N`: prompt = BOS + text;
   prefill; bonus = argmax; then repeatedly: draft [bonus, MASK x 15] at P..P+15 with dev/dflash_ref.py's
   draft_logits on the fused taps of the committed positions < P; verify the block with one target pass; keep the
   longest prefix of drafts equal to the target's argmax, plus the target's next token; the taps of the committed
   rows become context. The target is transformers' LagunaForCausalLM in fp32 (run on the whole sequence every
   step: no cache, no rollback to get wrong). tau = 1 + accepted / steps, summed over prompts, as eval.py.
2. On the same greedy outputs, teacher-forced (what train_drafter.py can afford): for every position p of the
   continuation, L_p = 1 + the matching-prefix length of the block drafted at p. Two ways to turn L_p into a tau:
     - "uniform anchors": mean of L_p over all positions (what train_drafter.py reported before): an arithmetic mean;
     - "chain": walk p -> p + L_p from the first bonus, as the loop does (steps visit few positions where L_p
       is large): must equal the loop's tau (the check that the chain is an honest predictor).
   --synthetic K adds K sequences built like the old training-time held-out set (32-token windows of the held-out
   files + the target's greedy continuation to 256 tokens) and reports on them: the old metric exactly (mean L
   over the anchors 1..240, prompt included), the same over the continuation only, and the chain over the
   continuation (the loop's tau had those 32 tokens been the prompt).
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import dflash_metric  # noqa: E402
from dflash_ref import LagunaDFlash  # noqa: E402

BOS = 2


def load_drafter(path):
    from safetensors.torch import load_file
    cfg = json.load(open(os.path.join(path, "config.json")))
    d = LagunaDFlash(cfg).float().eval()
    sd = load_file(os.path.join(path, "model.safetensors"))
    own = d.state_for_disk()
    assert set(sd) == set(own), (set(sd) ^ set(own))
    # state_for_disk returns detached views of the parameters: copying into them loads the weights
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(sd[k].float())
    return d


class Target:
    """transformers LagunaForCausalLM (fp32, eager experts) with hooks on the tap layers."""

    def __init__(self, path, layer_ids):
        from transformers import LagunaForCausalLM
        self.model = LagunaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        try:
            self.model.set_experts_implementation("eager")
        except Exception:                               # noqa: BLE001
            pass
        self.layer_ids, self.got = layer_ids, {}
        for t in layer_ids:
            self.model.model.layers[t].register_forward_hook(
                lambda mod, inp, out, t=t: self.got.__setitem__(t, out[0] if isinstance(out, tuple) else out))

    @torch.no_grad()
    def run(self, ids):
        """ids [T] -> logits [T, V], taps [T, n_taps, H] (the last tap before the final norm)"""
        self.got.clear()
        logits = self.model(input_ids=ids[None]).logits[0].float()
        return logits, torch.stack([self.got[t][0] for t in self.layer_ids], 1).float()

    @torch.no_grad()
    def greedy_batch(self, prompts, n):
        """[N, T] prompts of one length -> [N, T + n] with their greedy continuations (KV cache)."""
        out = self.model(input_ids=prompts, use_cache=True, logits_to_keep=1)
        seq, nxt = [prompts], out.logits[:, -1].argmax(-1)
        for _ in range(n - 1):
            seq.append(nxt[:, None])
            out = self.model(input_ids=nxt[:, None], past_key_values=out.past_key_values, use_cache=True,
                             logits_to_keep=1)
            nxt = out.logits[:, -1].argmax(-1)
        return torch.cat(seq + [nxt[:, None]], 1)

    @torch.no_grad()
    def greedy(self, ids, n):
        out = self.model.generate(input_ids=ids[None], max_new_tokens=n, do_sample=False, use_cache=True,
                                  eos_token_id=None, pad_token_id=0)
        return out[0, ids.numel():]


@torch.no_grad()
def dflash_generate(target, drafter, embed, lm_head, prompt, n):
    """laguna.c generate_dflash at temperature 0. Returns (generated ids, steps, accepted, accepted_at[B-1])."""
    B = drafter.block
    logits, taps = target.run(prompt)
    seq = prompt.tolist()
    ctx = drafter.context(taps)                        # fused context of every committed position
    P = len(seq)
    bonus = int(logits[-1].argmax())
    out, steps, accepted, at = [], 0, 0, [0] * (B - 1)
    eos = set(target.model.config.eos_token_id if isinstance(target.model.config.eos_token_id, list)
              else [target.model.config.eos_token_id])
    while True:
        out.append(bonus)
        if bonus in eos or len(out) >= n:
            break
        nblk = min(B, n - len(out) + 1)                # no point drafting past n (as laguna.c)
        lo = max(0, P - (drafter.window or P))          # the drafter's window never reads older context
        dl = drafter.draft_logits(ctx[lo:P], torch.arange(lo, P), bonus, P, B, embed, lm_head)
        drafts = dl[:nblk - 1].argmax(-1).tolist()      # causal block: a shorter block drafts the same tokens
        block = [bonus] + drafts
        logits, taps = target.run(torch.tensor(seq + block))
        t = logits[P:P + nblk].argmax(-1).tolist()     # t[j]: the target's token at position P+j+1
        acc = 0
        while acc < nblk - 1 and drafts[acc] == t[acc]:
            acc += 1
        steps += 1
        accepted += acc
        for j in range(acc):
            at[j] += 1
        seq += block[:acc + 1]
        ctx = torch.cat([ctx, drafter.context(taps[P:P + acc + 1])])
        stop = False
        for j in range(acc):
            out.append(drafts[j])
            if drafts[j] in eos or len(out) >= n:
                stop = True
                break
        if stop:
            break
        P += acc + 1
        bonus = t[acc]
    return out, steps, accepted, at


@torch.no_grad()
def teacher_forced_lengths(target, drafter, embed, lm_head, seq, start):
    """L_p for every position p >= start of seq (the target's greedy output from start on): 1 + how many drafts
    of the block [seq[p], MASK...] at p equal seq[p+1..] (the target's greedy tokens), one batched forward."""
    logits, taps = target.run(seq)
    T = seq.numel()
    ctx = drafter.context(taps)[None]
    anchors = torch.arange(start, T - 1)[None]
    return dflash_metric.block_lengths(drafter, ctx, seq[None], logits.argmax(-1)[None], anchors, embed,
                                       lm_head)[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=os.path.join(ROOT, "models", "src", "tiny"))
    ap.add_argument("--drafter", default=os.path.join(ROOT, "models", "src", "tiny-dflash"))
    ap.add_argument("--heldout", default=os.path.join(ROOT, "models", "src", "tiny-train", "heldout.json"))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--n", type=int, default=128)
    ap.add_argument("--synthetic", type=int, default=0, help="also this many old-style held-out greedy sequences")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(a.target, "tokenizer.json"))
    drafter = load_drafter(a.drafter)
    target = Target(a.target, drafter.taps)
    embed = target.model.model.embed_tokens.weight.detach().float()
    lm_head = target.model.lm_head.weight.detach().float()
    ho = json.load(open(a.heldout, encoding="utf-8"))
    res = {"target": a.target, "drafter": a.drafter, "n": a.n, "per_prompt": []}
    tot_steps = tot_acc = 0
    at_sum = [0] * (drafter.block - 1)
    Ls = []
    t0 = time.time()
    for i, p in enumerate(ho["prompts"][:a.prompts]):
        prompt = torch.tensor([BOS] + tok.encode(p["text"], add_special_tokens=False).ids)
        out, steps, acc, at = dflash_generate(target, drafter, embed, lm_head, prompt, a.n)
        tot_steps, tot_acc = tot_steps + steps, tot_acc + acc
        at_sum = [x + y for x, y in zip(at_sum, at)]
        plain = target.greedy(prompt, len(out)).tolist()
        L = teacher_forced_lengths(target, drafter, embed, lm_head, torch.tensor(prompt.tolist() + out),
                                   prompt.numel())
        Ls.append(L)
        chain = dflash_metric.chain(L, len(out), drafter.block)
        res["per_prompt"].append({"prompt": i, "prompt_tokens": prompt.numel(), "steps": steps, "accepted": acc,
                                  "tau": 1 + acc / max(1, steps), "same_as_plain_greedy": plain == out,
                                  "chain_steps": chain[0], "chain_accepted": chain[1],
                                  "uniform_anchor_tau": L.float().mean().item()})
        print(f"prompt {i:2d} ({prompt.numel():3d} tokens): loop {steps:3d} steps {acc:4d} accepted tau "
              f"{1 + acc / max(1, steps):.2f} | chain {chain[0]:3d} steps tau {1 + chain[1] / max(1, chain[0]):.2f}"
              f" | uniform anchors {L.float().mean():.2f} | output = plain greedy: {plain == out}  "
              f"({time.time() - t0:.0f} s)", flush=True)
    S = max(1, tot_steps)
    if not Ls:
        Ls = [torch.zeros(0)]
    cs = sum(r["chain_steps"] for r in res["per_prompt"])
    ca = sum(r["chain_accepted"] for r in res["per_prompt"])
    allL = torch.cat(Ls).float()
    res.update(steps=tot_steps, accepted=tot_acc, tau=1 + tot_acc / S, per_position=[x / S for x in at_sum],
               chain_tau=1 + ca / max(1, cs), uniform_anchor_tau=allL.mean().item(),
               harmonic_mean_L=(1 / (1 / allL).mean()).item())
    print(f"loop: {tot_steps} steps, {tot_acc} accepted, tau {res['tau']:.3f}; per position "
          + " ".join(f"{x:.2f}" for x in res["per_position"]))
    print(f"teacher-forced on the same outputs: chain tau {res['chain_tau']:.3f}; uniform anchors (old training "
          f"metric) {res['uniform_anchor_tau']:.3f}; harmonic mean of L {res['harmonic_mean_L']:.3f}")

    if a.synthetic:     # old-style held-out greedy sequences: 32-token windows of held-out files + continuation
        g = torch.Generator().manual_seed(0)
        ids = [int(x) for f in ho["files"] for x in ([BOS] + [int(y) for y in f["ids"].split()])]
        ids = torch.tensor(ids)
        starts = torch.randint(0, ids.numel() - 32, (a.synthetic,), generator=g)
        prompts = torch.stack([ids[int(s):int(s) + 32] for s in starts])
        seqs = target.greedy_batch(prompts, 224)
        syn = []
        for seq in seqs:
            L = teacher_forced_lengths(target, drafter, embed, lm_head, seq, 1)
            Lc = L[31:]                                   # anchors in the continuation only
            ch = dflash_metric.chain(Lc, Lc.numel() + 1, drafter.block)
            syn.append({"uniform_all": L[:240].float().mean().item(), "uniform_cont": Lc.float().mean().item(),
                        "chain_steps": ch[0], "chain_accepted": ch[1]})
        res["synthetic"] = {
            "sequences": a.synthetic,
            "uniform_anchor_tau": sum(x["uniform_all"] for x in syn) / len(syn),
            "uniform_anchor_tau_continuation": sum(x["uniform_cont"] for x in syn) / len(syn),
            "chain_tau": 1 + sum(x["chain_accepted"] for x in syn) / max(1, sum(x["chain_steps"] for x in syn))}
        print(f"old-style held-out greedy sequences ({a.synthetic}): uniform anchors {res['synthetic']['uniform_anchor_tau']:.3f}"
              f" (continuation only {res['synthetic']['uniform_anchor_tau_continuation']:.3f}); chain tau "
              f"{res['synthetic']['chain_tau']:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
