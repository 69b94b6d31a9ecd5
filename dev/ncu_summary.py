"""Per-kernel table of the last decode step in an ncu CSV (dev/device_perf.sh):
    python3 dev/ncu_summary.py ncu.csv
ncu --csv prints one row per (kernel launch, metric); the last decode step is everything from the last
embed_kernel launch on (the graph replays the step's kernels in order)."""
import csv
import sys


def main(path):
    lines = open(path).read().splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
    launches = {}
    for row in csv.DictReader(lines[start:]):
        k = launches.setdefault(int(row["ID"]), {"name": row["Kernel Name"], "grid": row["Grid Size"],
                                                 "block": row["Block Size"]})
        k[row["Metric Name"]] = float(row["Metric Value"].replace(",", "") or 0)
    ids = sorted(launches)
    first = max(i for i in ids if "embed_kernel" in launches[i]["name"])
    total_us = total_b = 0.0
    print(f"{'kernel':60s} {'us':>8s} {'MB read':>9s} {'GB/s':>7s}  grid / block")
    for i in ids:
        if i < first:
            continue
        k = launches[i]
        us = k.get("gpu__time_duration.sum", 0) / 1e3
        b = k.get("dram__bytes_read.sum", 0)
        total_us += us
        total_b += b
        name = k["name"].split("(")[0][:60]
        print(f"{name:60s} {us:8.2f} {b / 1e6:9.2f} {b / max(us, 1e-9) / 1e3:7.0f}  {k['grid']} / {k['block']}")
    print(f"{'sum over the step':60s} {total_us:8.2f} {total_b / 1e6:9.2f} {total_b / max(total_us, 1e-9) / 1e3:7.0f}")


if __name__ == "__main__":
    main(sys.argv[1])
