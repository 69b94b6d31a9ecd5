#!/usr/bin/env python3
"""dev/trace_summary.py -- one traced decode step, kernel by kernel (the CSV of make dev/bench_gpu_trace).

    LAGUNA_TRACE_OUT=trace.csv ./dev/bench_gpu_trace FILE 512 && python3 dev/trace_summary.py trace.csv

Rows of the CSV are thread blocks: gridid,block,smid,t_start,t_wait,t_end (%globaltimer ns; t_wait 0: the block left
before griddep_wait), cyc_wait,cyc_end (clock64 cycles start -> wait, wait -> end), clk_start (clock64 at the start),
m0..m5 (TRACE_MARK(i): ns after the block's start, 0 if not reached; table (c) shows them after each block's wait;
which marks a kernel records can depend on the run's LAGUNA_TRACE_MODE: laguna.cu's TRACE_MARK_IF).
Table (d): the blocks themselves -- how many started before the previous grid ended (under PDL), how many of the
grid's blocks were resident on average over its step and at most, and how long the blocks that started after the
previous grid's end took from their start to their end. Table (e): for the grids that ran at most two blocks on any
SM (the one-token attention's clusters), how many SMs ran two of them, and their blocks' end against the others'.
Grids (one per kernel launch) are ordered by their first block's start. Per grid, in us from the step's first start:
start / last start = first and last block start, wait = earliest griddep_wait return (a grid without any: its start),
end = last block end; gap = wait - the previous grid's end, pre = wait - start (what PDL overlapped), span = end -
wait, step = end - the previous grid's end (= gap + span: the grid's share of the step).
The step is the embedding, the layers (split evenly into --layers, or after each kernel with the last layer's last
kernel's block count) and lm_head + the sampler; layers whose kernels have the same block counts are one kind.
--clock: times from each SM's clock64 (rate fitted over all blocks, one offset per SM from its %globaltimer
readings) instead of %globaltimer itself, for when the timer's steps are coarse (the script prints them).
"""
import argparse
import sys
import warnings

import numpy as np

NAMES = {6: ["q/k/v/g", "attention", "o_proj", "router|norm", "gate/up", "down"],
         8: ["q/k/v/g", "qk_norm_rope", "attn_flash", "attn_combine", "o_proj", "router|norm", "gate/up", "down"]}


def load(path, use_clock):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                     # an empty file: said below
        a = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.uint64, ndmin=2)
    if len(a) == 0:
        sys.exit(f"{path}: no records")
    grid, smid = a[:, 0], a[:, 2].astype(np.int64)
    waited = a[:, 4] != 0
    t0 = a[:, 3].min()
    ts = (a[:, 3] - t0).astype(np.float64)                  # integers first: ns since boot do not fit a float64
    tw = np.where(waited, a[:, 4].astype(np.int64) - np.int64(t0), 0).astype(np.float64)
    te = (a[:, 5] - t0).astype(np.float64)
    cw, ce = a[:, 6].astype(np.float64), a[:, 7].astype(np.float64)
    vals = np.unique(np.concatenate([ts, tw[waited], te]))
    res = np.diff(vals).min() if len(vals) > 1 else 0.0
    print(f"{len(a)} blocks, {len(np.unique(grid))} grids, {len(np.unique(smid))} SMs; %globaltimer: smallest step "
          f"between distinct readings {res:.0f} ns" + ("  (coarse: try --clock)" if res >= 200 and not use_clock else ""))
    tw = np.where(waited, tw, ts)
    # clock64 per SM against %globaltimer: one rate for all SMs (least squares within each SM), an offset per SM
    c0 = a[:, 8].astype(np.int64)
    cs = np.zeros(len(a))
    for s in np.unique(smid):                               # cycles from the SM's first reading (float64-safe)
        m = smid == s
        cs[m] = (c0[m] - c0[m].min()).astype(np.float64)
    cwt, cet = cs + cw, cs + cw + ce
    sm3, c3, t3 = np.tile(smid, 3), np.concatenate([cs, cwt, cet]), np.concatenate([ts, tw, te])
    _, k = np.unique(sm3, return_inverse=True)
    cnt = np.bincount(k)
    dc = c3 - (np.bincount(k, c3) / cnt)[k]
    dt = t3 - (np.bincount(k, t3) / cnt)[k]
    ghz = (dc * dc).sum() / (dc * dt).sum()
    print(f"SM clock from clock64 against %globaltimer: {ghz:.4f} GHz")
    if use_clock:                                           # t = cycles / ghz + the SM's offset
        off = (np.bincount(k, t3 - c3 / ghz) / cnt)[k[:len(a)]] + res / 2   # a floored timer reads res / 2 low
        ts, tw, te = cs / ghz + off, cwt / ghz + off, cet / ghz + off
        tmin = ts.min()
        ts, tw, te = ts - tmin, tw - tmin, te - tmin
    # TRACE_MARK(i) (columns 9..14, when present): ns after the block's start; here: us after its own wait return
    marks = np.full((len(a), 6), np.nan)
    if a.shape[1] >= 15:
        m = a[:, 9:15].astype(np.float64)
        own_wait = (a[:, 4].astype(np.int64) - a[:, 3].astype(np.int64)).astype(np.float64)
        own_wait = np.where(waited, own_wait, 0.0)
        marks = np.where(m > 0, (m - own_wait[:, None]) / 1e3, np.nan)
    return grid, ts, tw, te, waited, marks, smid


def grids(grid, ts, tw, te, waited, marks):
    ids, inv = np.unique(grid, return_inverse=True)
    n = len(ids)
    g = {k: np.full(n, v) for k, v in (("start", np.inf), ("last", -np.inf), ("wait", np.inf), ("end", -np.inf))}
    np.minimum.at(g["start"], inv, ts)
    np.maximum.at(g["last"], inv, ts)
    np.minimum.at(g["wait"], inv, np.where(waited, tw, np.inf))
    np.maximum.at(g["end"], inv, te)
    g["blocks"] = np.bincount(inv, minlength=n)
    have = ~np.isnan(marks)                                 # per grid, the mean of each mark over its blocks
    cnt = np.zeros((n, 6))
    tot = np.zeros((n, 6))
    np.add.at(cnt, inv, have)
    np.add.at(tot, inv, np.where(have, marks, 0.0))
    g["marks"] = np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)
    own = np.zeros(n)                                       # and of each block's end after its own wait return
    np.add.at(own, inv, (te - tw) / 1e3)
    g["own"] = own / g["blocks"]
    g["waited"] = np.bincount(inv, weights=waited, minlength=n).astype(int)
    g["wait"] = np.where(np.isfinite(g["wait"]), g["wait"], g["start"])
    g["id"] = ids
    o = np.argsort(g["start"], kind="stable")
    g = {k: v[o] for k, v in g.items()}
    prev_end = np.concatenate([[g["start"][0]], g["end"][:-1]])
    g["gap"] = g["wait"] - prev_end
    g["gap"][0] = 0.0
    g["pre"] = g["wait"] - g["start"]
    g["span"] = g["end"] - g["wait"]
    g["step"] = g["end"] - prev_end
    g["launch"] = g["start"] - prev_end
    return g


def lm_head_index(blocks, n_layers=0):
    """lm_head: the last of the grids with the most blocks (V / 8 rows a block: more than any layer's); the sampler's
    grids follow it (one greedy, several when sampling). A kernel launched as one wave of blocks (a looping lm_head)
    has fewer: then the grid that leaves a whole number of grids a layer before it and at most 16 sampler grids after"""
    if len(blocks) < 3:
        return len(blocks) - 2
    most = max(blocks[1:])
    i = max(i for i in range(1, len(blocks)) if blocks[i] == most)
    if n_layers <= 0 or (i - 1) % n_layers == 0:
        return i
    fits = [j for j in range(1 + n_layers, len(blocks)) if (j - 1) % n_layers == 0 and len(blocks) - 1 - j <= 16]
    return fits[-1] if fits else i


def split_layers(blocks, n_layers, lm, by_start=False):
    """the indices of the grids between the embedding and lm_head (index lm), per layer, or None; by_start: a layer
    begins at each grid with the first one's block count (q/k/v/g: in q8 / q4 files one wave of looping blocks in
    every layer; bf16's q/k/v/g has a block count per head count, 48 or 64)"""
    mid = list(range(1, lm))
    if by_start and n_layers > 0 and mid:
        starts = [i for i in mid if blocks[i] == blocks[mid[0]]] + [lm]
        layers = [list(range(a, b)) for a, b in zip(starts, starts[1:])]
        return layers if len(layers) == n_layers else None
    if n_layers > 0 and len(mid) % n_layers == 0 and len(mid) >= n_layers:
        k = len(mid) // n_layers
        return [mid[i:i + k] for i in range(0, len(mid), k)]
    if not mid:
        return None
    layers, cur = [], []
    for i in mid:                                           # each layer ends with the kernel the last layer ends with
        cur.append(i)
        if blocks[i] == blocks[mid[-1]]:
            layers.append(cur)
            cur = []
    return layers if not cur and (n_layers <= 0 or len(layers) == n_layers) else None


def find_layers(blocks, n_layers):
    """(lm_head's index, the layers' grids or None). When the layers do not all run the same number of kernels (full
    layers on the long-context attention: 8 grids, sliding ones 6), lm_head_index's whole-number rule cannot place a
    looping lm_head: then the last grid, at most 16 from the end, before which the layers split into n_layers, each
    beginning with q/k/v/g's block count"""
    lm = lm_head_index(blocks, n_layers)
    layers = split_layers(blocks, n_layers, lm)
    if layers or n_layers <= 0:
        return lm, layers
    for j in range(len(blocks) - 2, max(len(blocks) - 18, 1), -1):
        layers = split_layers(blocks, n_layers, j, by_start=True)
        if layers:
            return j, layers
    return lm, None


def residency(grid, ts, te, gid, prev_end, end):
    """one grid's blocks: (started before prev_end, mean resident over [prev_end, end], peak resident, mean start ->
    end of the blocks started at or after prev_end), times in ns"""
    m = grid == gid
    s, e = ts[m], te[m]
    early = int((s < prev_end).sum())
    mean_res = np.clip(np.minimum(e, end) - np.maximum(s, prev_end), 0, None).sum() / max(end - prev_end, 1.0)
    ev = np.concatenate([np.stack([s, np.ones_like(s)], 1), np.stack([e, -np.ones_like(e)], 1)])
    ev = ev[np.lexsort((ev[:, 1], ev[:, 0]))]               # at equal times the ends (-1) first
    peak = int(np.cumsum(ev[:, 1]).max())
    late = s >= prev_end
    return early, mean_res, peak, float((e[late] - s[late]).mean()) if late.any() else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--layers", type=int, default=40, help="layers in the model (default 40: XS-2.1)")
    ap.add_argument("--clock", action="store_true", help="times from the SMs' clock64, aligned per SM")
    ap.add_argument("--brief", action="store_true", help="in (a) only the first two and the last layer")
    args = ap.parse_args()
    data = load(args.csv, args.clock)
    g = grids(*data[:6])
    n = len(g["blocks"])
    us = {k: g[k] / 1e3 for k in ("start", "last", "wait", "end", "gap", "pre", "span", "step", "launch")}
    lm, layers = find_layers(g["blocks"], args.layers)
    label = [f"#{i}" for i in range(n)]
    samplers = list(range(lm + 1, n))
    if n >= 3:
        label[0], label[lm] = "embed", "lm_head"
        for j, i in enumerate(samplers):
            label[i] = "sample" if len(samplers) == 1 else f"sample.{j}"
    if layers:
        for li, idx in enumerate(layers):
            names = NAMES.get(len(idx), [f"k{j}" for j in range(len(idx))])
            for j, i in enumerate(idx):
                label[i] = f"L{li}.{names[j]}"
    elif n > 3:
        print(f"warning: the {lm - 1} grids between the embedding and lm_head do not split into {args.layers} "
              "layers of a fixed pattern (--layers N to change): the full list only", file=sys.stderr)

    print("\n(a) every grid, us from the step's first start (gap: wait - previous end; pre: wait - start; span: end - "
          "wait; step: end - previous end)")
    hdr = f"{'#':>4} {'kernel':<18} {'blocks':>6} {'waited':>6} {'start':>9} {'last st':>9} {'wait':>9} {'end':>9} " \
          f"{'gap':>7} {'pre':>7} {'span':>7} {'step':>7}"
    print(hdr)
    show = set(range(n))
    if layers and args.brief:                               # the embedding, the first two and last layers, the end
        show = {0, lm} | set(samplers) | set(i for idx in layers[:2] + layers[-1:] for i in idx)
    skipped = False
    for i in range(n):
        if i not in show:
            if not skipped:
                print(f"{'...':>4}")
            skipped = True
            continue
        skipped = False
        print(f"{i:>4} {label[i]:<18} {g['blocks'][i]:>6} {g['waited'][i]:>6} {us['start'][i]:>9.2f} "
              f"{us['last'][i]:>9.2f} {us['wait'][i]:>9.2f} {us['end'][i]:>9.2f} {us['gap'][i]:>7.2f} "
              f"{us['pre'][i]:>7.2f} {us['span'][i]:>7.2f} {us['step'][i]:>7.2f}")

    if layers:
        kinds = {}
        for li, idx in enumerate(layers):
            kinds.setdefault(tuple(g["blocks"][idx]), []).append(li)
        print(f"\n(b) per kind of layer ({len(layers)} layers; a kind: the same kernels' block counts), mean us "
              "(launch: first start - previous end, < 0: started early under PDL)")
        for sig, lis in kinds.items():
            rng = ",".join(str(x) for x in lis) if len(lis) <= 8 else f"{lis[0]},{lis[1]},...,{lis[-1]}"
            lsum = np.mean([us["step"][layers[li]].sum() for li in lis])
            print(f"kind of {len(lis)} layer(s) [{rng}]: {lsum:.2f} us a layer")
            print(f"  {'slot':<14} {'blocks':>6} {'launch':>7} {'pre':>7} {'gap':>7} {'span':>7} {'step':>7} "
                  f"{'step sd':>7}")
            names = NAMES.get(len(sig), [f"k{j}" for j in range(len(sig))])
            for j, b in enumerate(sig):
                idx = [layers[li][j] for li in lis]
                m = {k: us[k][idx].mean() for k in ("launch", "pre", "gap", "span", "step")}
                print(f"  {names[j]:<14} {b:>6} {m['launch']:>7.2f} {m['pre']:>7.2f} {m['gap']:>7.2f} "
                      f"{m['span']:>7.2f} {m['step']:>7.2f} {us['step'][idx].std():>7.2f}")
        if not np.isnan(g["marks"]).all():
            print("\n(c) inside the blocks: TRACE_MARK(0..5) and the block's end, mean us after the block's own wait "
                  "return (- : no mark)")
            for sig, lis in kinds.items():
                print(f"kind [{lis[0]},...]:")
                names = NAMES.get(len(sig), [f"k{j}" for j in range(len(sig))])
                for j in range(len(sig)):
                    idx = [layers[li][j] for li in lis]
                    with warnings.catch_warnings():       # a mark no block of the slot reached: nan
                        warnings.simplefilter("ignore")
                        mk = np.nanmean(g["marks"][idx], axis=0)
                    cells = " ".join(f"{v:>6.2f}" if not np.isnan(v) else f"{'-':>6}" for v in mk)
                    print(f"  {names[j]:<14} {cells}   end {g['own'][idx].mean():>6.2f}")
            print("the sampler's grids (greedy: the argmax; sampling: stats, radix 0 / 1 / 2, mass, pick): blocks, "
                  "us from the previous grid's end to this one's (step), own end after its wait")
            for i in samplers:
                print(f"  {label[i]:<14} {g['blocks'][i]:>6} step {us['step'][i]:>7.2f}   end {g['own'][i]:>6.2f}")

    if layers:
        grid, ts, te = data[0], data[1], data[3]
        prev_end = np.concatenate([[g["start"][0]], g["end"][:-1]])
        print("\n(d) the blocks: started before the previous grid's end, resident on average over the step and at "
              "most, and the later blocks' start -> end (us)")
        for sig, lis in kinds.items():
            print(f"kind [{lis[0]},...]:")
            print(f"  {'slot':<14} {'blocks':>6} {'early':>6} {'mean':>6} {'peak':>6} {'late us':>7}")
            names = NAMES.get(len(sig), [f"k{j}" for j in range(len(sig))])
            for j, b in enumerate(sig):
                r = np.array([residency(grid, ts, te, g["id"][i], prev_end[i], g["end"][i])
                              for i in (layers[li][j] for li in lis)])
                with warnings.catch_warnings():           # no late blocks anywhere: nan
                    warnings.simplefilter("ignore")
                    late = np.nanmean(r[:, 3]) / 1e3
                print(f"  {names[j]:<14} {b:>6} {r[:, 0].mean():>6.0f} {r[:, 1].mean():>6.0f} {r[:, 2].mean():>6.0f} "
                      f"{late:>7.2f}")

    if layers:
        grid, tw, te, smid = data[0], data[2], data[3], data[6]
        print("\n(e) grids of at most two blocks an SM: SMs that ran two or more of the grid's blocks, and the blocks' "
              "own end after their wait on SMs with one block / with two or more (mean us; SMs: mean over the layers)")
        for sig, lis in kinds.items():
            names = NAMES.get(len(sig), [f"k{j}" for j in range(len(sig))])
            rows = []
            for j, b in enumerate(sig):
                shared_sms, one, two = [], [], []
                for i in (layers[li][j] for li in lis):
                    m = grid == g["id"][i]
                    per_sm = np.bincount(smid[m])
                    if per_sm.max() > 2:                  # several waves: not this table's case
                        break
                    on_two = per_sm[smid[m]] >= 2
                    own = (te[m] - tw[m]) / 1e3
                    shared_sms.append(int((per_sm >= 2).sum()))
                    one.extend(own[~on_two])
                    two.extend(own[on_two])
                else:
                    rows.append(f"  {names[j]:<14} {b:>6} SMs {np.mean(shared_sms):>6.1f}   one "
                                f"{np.mean(one) if one else float('nan'):>6.2f}   two+ "
                                f"{np.mean(two) if two else float('nan'):>6.2f}")
            if rows:
                print(f"kind [{lis[0]},...]:")
                print("\n".join(rows))

    total = us["end"][-1] - us["start"][0]
    print(f"\nstep: {total:.1f} us from the first start to the last end, {n} grids")
    print(f"sum of gaps {us['gap'].sum():.1f} us ({100 * us['gap'].sum() / total:.1f}%), sum of post-wait spans "
          f"{us['span'].sum():.1f} us ({100 * us['span'].sum() / total:.1f}%), the first grid's pre-wait "
          f"{us['pre'][0]:.1f} us; sum of pre-wait overlaps {us['pre'].sum():.1f} us (hidden under earlier grids)")
    if n > 1 and (us["gap"][1:] < -0.5).any():
        print(f"note: {(us['gap'][1:] < -0.5).sum()} grid(s) waited before the previous one ended (gap < -0.5 us): "
              "not in PDL order, or the timer's resolution")


if __name__ == "__main__":
    main()
