#!/usr/bin/env python3
"""Plot a `flexoffload bench` CSV: decode tok/s against the memory budget, one line per strategy
(the style of FlexInfer's Figure 4).

    scripts/plot_bench.py results/mmap_qwen1.5b.csv results/mmap_qwen1.5b.png
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(csv_path: str, png_path: str) -> None:
    lines = defaultdict(list)
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        if int(r["runs"]) > 0 or r["strategy"] == "roofline":
            lines[r["strategy"]].append((float(r["budget_mb"]), float(r["tok_s_mean"]), float(r["tok_s_sd"])))
    fig, ax = plt.subplots(figsize=(6, 4))
    for strategy, points in lines.items():
        points.sort()
        x, y, sd = zip(*points)
        style = {"linestyle": "--", "color": "black"} if strategy == "roofline" else {"marker": "o", "capsize": 3}
        ax.errorbar(x, y, yerr=sd, label=strategy, **style)
    ax.set_xlabel("memory budget (MiB), enforced by a cgroup")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{rows[0]['model']} ({float(rows[0]['size_mb']):.0f} MiB)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
