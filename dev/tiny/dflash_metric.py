"""The mean accepted length tau of a DFlash drafter, measured the way the speculative loop earns it.

At temperature 0 the loop on a prompt is fully determined by the target's greedy output g and, for every
position p of it, L_p = 1 + the length of the longest prefix of the block drafted at p (bonus g[p], context =
the target's taps of the positions < p) that equals g[p+1..]. The loop drafts at the first bonus, jumps to
p + L_p, drafts there, and so on: tau = tokens / steps. So tau can be computed exactly from one teacher-forced
pass over g (every position an anchor) -- `chain` below; laguna.c, dev/tiny/dflash_loop.py and this agree.

What tau is *not*: the mean of L_p over uniformly drawn positions (an arithmetic mean). The loop visits a
stretch where L_p = 16 once per 16 tokens but a stretch where L_p = 1 at every token, so tau is close to the
harmonic mean of L_p along the output, which is much lower whenever L_p varies (e.g. half 16, half 1: arithmetic
8.5, loop 1.9).
"""
import torch
import torch.nn.functional as F


@torch.no_grad()
def block_lengths(drafter, ctx, seq, pred, anchors, embed, lm_head, amp=None, chunk=64):
    """L [N, K]: 1 + matching-prefix length of the block drafted at each anchor.

    ctx [N, T, H] fused context (drafter.context of the target's taps), seq [N, T] tokens, pred [N, T] the
    target's greedy token after each position (pred[t] is the token the target puts at t+1), anchors [N, K]
    in 0..T-2. The draft at slot o of the block at p must equal pred[p+o-1] (the verify rule); slots past the
    end of the sequence count as rejected. Anchors are processed `chunk` at a time (memory)."""
    N, T = seq.shape
    B = drafter.block
    out = []
    for k0 in range(0, anchors.shape[1], chunk):
        anc = anchors[:, k0:k0 + chunk]
        K = anc.shape[1]
        tokens = torch.full((N, K, B), drafter.mask_id, device=seq.device, dtype=torch.long)
        tokens[:, :, 0] = seq.gather(1, anc)
        lab_pos = anc[:, :, None] + torch.arange(0, B - 1, device=seq.device)          # row p+o-1, o = 1..B-1
        valid = lab_pos + 1 < T                                                        # position p+o exists
        lab = pred.gather(1, lab_pos.clamp(max=T - 1).reshape(N, -1)).reshape(N, K, B - 1)
        if amp is None:
            hid = drafter.train_forward(ctx, anc, tokens, embed)
            logits = F.linear(hid[:, :, 1:], lm_head.to(hid.dtype))
        else:
            with amp():
                hid = drafter.train_forward(ctx, anc, tokens, embed)
                logits = F.linear(hid[:, :, 1:], lm_head)
        match = (logits.argmax(-1) == lab) & valid
        out.append(1 + match.long().cumprod(-1).sum(-1))
    return torch.cat(out, 1)


def chain(L, n, block=16):
    """Walk the speculative loop over one greedy output of n tokens whose first token (the first bonus) is
    index 0 of L (L[i] for the block drafted at output index i). Mirrors laguna.c generate_dflash: a block never
    drafts past n. Returns (verify steps, accepted drafts, accepted_at) where accepted_at[j] counts the steps
    whose draft slot j+1 was accepted (laguna's "acceptance per block position" times steps)."""
    L = L.tolist() if torch.is_tensor(L) else list(L)
    committed, i, steps, accepted, at = 1, 0, 0, 0, [0] * (block - 1)
    while committed < n:
        nblk = min(block, n - committed + 1)
        acc = min(L[i] - 1, nblk - 1)
        steps += 1
        accepted += acc
        for j in range(acc):
            at[j] += 1
        committed += acc
        if committed >= n:
            break
        i += acc + 1
        committed += 1                       # the target's token after the accepted drafts: the next bonus
    return steps, accepted, at
