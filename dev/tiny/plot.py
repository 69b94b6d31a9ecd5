#!/usr/bin/env python3
"""Plot the tiny model's training curves and the DFlash acceptance per block position.

    python3 dev/tiny/plot.py [--train models/src/tiny-train] [--eval eval.json] [--out DIR]

Writes DIR/tiny_loss.{png|svg} (target train / held-out loss against tokens; drafter train / held-out loss and
held-out tau against blocks, from drafter_loss.csv of train_drafter.py)
and, with --eval (the JSON of dev/tiny/eval.py), DIR/tiny_acceptance.{png|svg}. PNG with matplotlib when it can
be imported; otherwise a plain SVG written by hand (GitHub renders both in a README).
"""
import argparse
import csv
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def read_csv(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def col(rows, x, y):
    pts = [(float(r[x]), float(r[y])) for r in rows if r.get(x) not in (None, "") and r.get(y) not in (None, "")]
    return [p for p in pts if p[1] == p[1]]     # drop NaN


def panels(train_dir, ev):
    """[(title, xlabel, ylabel, [(label, points, kind)])]"""
    t = read_csv(os.path.join(train_dir, "target_loss.csv"))
    d = read_csv(os.path.join(train_dir, "drafter_loss.csv"))
    out = []
    if t:
        out.append(("target: cross-entropy", "tokens (M)", "loss (nats)",
                    [("train", [(x / 1e6, y) for x, y in col(t, "tokens", "train_loss")], "line"),
                     ("held-out", [(x / 1e6, y) for x, y in col(t, "tokens", "val_loss")], "line")]))
    if d:
        out.append(("drafter: block cross-entropy (slot-weighted)", "blocks (M)", "loss (nats)",
                    [("train (mean since the last eval)", [(x / 1e6, y) for x, y in col(d, "blocks", "train_loss")],
                      "line"),
                     ("held-out", [(x / 1e6, y) for x, y in col(d, "blocks", "val_loss")], "line")]))
        out.append(("drafter: held-out tau of the speculative loop", "blocks (M)", "tau",
                    [("tau (the loop's, as laguna)", [(x / 1e6, y) for x, y in col(d, "blocks", "val_tau")], "line"),
                     ("mean L over anchors (optimistic)",
                      [(x / 1e6, y) for x, y in col(d, "blocks", "val_tau_uniform")], "line")]))
    acc = None
    if ev and ev.get("dflash"):
        dd = ev["dflash"]
        acc = [(f"acceptance per block position (laguna, tau {dd['tau']:.2f}, acceptance {dd['acceptance']:.3f})",
                "block position", "accepted / verify steps",
                [("", [(i + 1, v) for i, v in enumerate(dd["per_position"])], "bar")])]
    return out, acc


def png(pans, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(pans), figsize=(5.5 * len(pans), 3.6), squeeze=False)
    for ax, (title, xl, yl, series) in zip(axes[0], pans):
        for label, pts, kind in series:
            if not pts:
                continue
            xs, ys = zip(*pts)
            if kind == "bar":
                ax.bar(xs, ys, color="#4477aa")
                ax.set_ylim(0, 1)
            else:
                ax.plot(xs, ys, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        if any(lbl for lbl, _, _ in series):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def svg(pans, path):
    W, H, m = 460, 300, 50
    colours = ["#4477aa", "#ee6677", "#228833"]
    parts = []
    for k, (title, xl, yl, series) in enumerate(pans):
        ox = k * W
        pts = [p for _, s, _ in series for p in s]
        if not pts:
            continue
        x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
        y0, y1 = min(0.0, min(p[1] for p in pts)) if series[0][2] == "bar" else min(p[1] for p in pts), \
            max(p[1] for p in pts)
        if series[0][2] == "bar":
            x0, x1, y1 = x0 - 0.5, x1 + 0.5, max(1.0, y1)
        x1 = x1 if x1 > x0 else x0 + 1
        y1 = y1 if y1 > y0 else y0 + 1

        def X(x):
            return ox + m + (x - x0) / (x1 - x0) * (W - 2 * m)

        def Y(y):
            return H - m - (y - y0) / (y1 - y0) * (H - 2 * m)
        parts.append(f'<text x="{ox + W / 2}" y="20" text-anchor="middle" font-size="13">{title}</text>')
        parts.append(f'<rect x="{ox + m}" y="{m}" width="{W - 2 * m}" height="{H - 2 * m}" fill="none" stroke="#888"/>')
        for v, anchor in ((y0, "end"), (y1, "end")):
            parts.append(f'<text x="{ox + m - 4}" y="{Y(v) + 4}" text-anchor="{anchor}" font-size="10">{v:.3g}</text>')
        for v in (x0, x1):
            parts.append(f'<text x="{X(v)}" y="{H - m + 14}" text-anchor="middle" font-size="10">{v:.3g}</text>')
        parts.append(f'<text x="{ox + W / 2}" y="{H - 12}" text-anchor="middle" font-size="11">{xl}</text>')
        parts.append(f'<text x="{ox + 12}" y="{H / 2}" font-size="11" transform="rotate(-90 {ox + 12} {H / 2})" '
                     f'text-anchor="middle">{yl}</text>')
        for i, (label, s, kind) in enumerate(series):
            c = colours[i % len(colours)]
            if kind == "bar":
                bw = (W - 2 * m) / max(1, len(s)) * 0.7
                for x, y in s:
                    parts.append(f'<rect x="{X(x) - bw / 2:.1f}" y="{Y(y):.1f}" width="{bw:.1f}" '
                                 f'height="{Y(y0) - Y(y):.1f}" fill="{c}"/>')
            elif s:
                d = " ".join(f"{X(x):.1f},{Y(y):.1f}" for x, y in s)
                parts.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="1.5"/>')
            if label:
                parts.append(f'<text x="{ox + W - m - 4}" y="{m + 14 + 14 * i}" text-anchor="end" font-size="10" '
                             f'fill="{c}">{label}</text>')
    body = "\n".join(parts)
    with open(path, "w") as f:
        f.write(f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * len(pans)}" height="{H}" '
                f'font-family="sans-serif">\n<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n')


def write(pans, base):
    try:
        import matplotlib  # noqa: F401
        png(pans, base + ".png")
        print(f"wrote {base}.png")
    except ImportError:
        svg(pans, base + ".svg")
        print(f"wrote {base}.svg (matplotlib is not installed: SVG instead of PNG)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", default=os.path.join(ROOT, "models", "src", "tiny-train"))
    ap.add_argument("--eval", help="JSON written by dev/tiny/eval.py --out")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    ev = json.load(open(a.eval)) if a.eval else None
    curves, acc = panels(a.train, ev)
    os.makedirs(a.out, exist_ok=True)
    if curves:
        write(curves, os.path.join(a.out, "tiny_loss"))
    if acc:
        write(acc, os.path.join(a.out, "tiny_acceptance"))


if __name__ == "__main__":
    main()
