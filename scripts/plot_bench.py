#!/usr/bin/env python3
"""Plot a `flexoffload bench` CSV in the style of FlexInfer's figures.

Figure 4: decode tok/s against the memory budget, one line per strategy (the roofline dashed).
Figure 5 (optional second PNG): the speedup of balanced over attn-first and ffn-first at each budget.

    scripts/plot_bench.py results/flexinfer_qwen1.5b.csv FIG4.png [FIG5.png]
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def fig4(rows: list[dict], ax) -> None:
    lines = defaultdict(list)
    for r in rows:
        if int(r["runs"]) > 0 or r["strategy"] == "roofline":
            lines[r["strategy"]].append((float(r["budget_mb"]), float(r["tok_s_mean"]), float(r["tok_s_sd"])))
    for strategy, points in lines.items():
        points.sort()
        x, y, sd = zip(*points)
        style = {"linestyle": "--", "color": "black"} if strategy == "roofline" else {"marker": "o", "capsize": 3}
        ax.errorbar(x, y, yerr=sd, label=strategy, **style)
    ax.set_xlabel("memory budget (MiB), enforced by a cgroup")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{rows[0]['model']} ({float(rows[0]['size_mb']):.0f} MiB)")
    ax.grid(alpha=0.3)


def fig5(rows: list[dict], ax) -> None:
    ran = [r for r in rows if int(r["runs"]) > 0]
    speed = {(r["budget"], r["strategy"]): float(r["tok_s_mean"]) for r in ran}
    budgets = sorted({r["budget"] for r in ran if (r["budget"], "balanced") in speed},
                     key=lambda b: next(float(r["budget_mb"]) for r in ran if r["budget"] == b))
    width = 0.38
    for i, base in enumerate(("attn-first", "ffn-first")):
        ratios = [speed[b, "balanced"] / speed[b, base] if speed.get((b, base)) else 0 for b in budgets]
        ax.bar([x + (i - 0.5) * width for x in range(len(budgets))], ratios, width, label=f"balanced / {base}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set_xlabel("memory budget")
    ax.set_ylabel("speedup")
    ax.set_title(f"{rows[0]['model']}: balanced over the ablations")


def save(draw, rows: list[dict], png_path: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    draw(rows, ax)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        table = list(csv.DictReader(f))
    save(fig4, table, sys.argv[2])
    if len(sys.argv) == 4:
        save(fig5, table, sys.argv[3])
