#!/usr/bin/env python3
"""FlexInfer Figure 5 from a `flexoffload bench` CSV: the speedup of balanced over attn-first and ffn-first at
each budget.

    scripts/plot_fig5.py results/flexinfer_qwen1.5b.csv results/flexinfer_fig5_qwen1.5b.png
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(csv_path: str, png_path: str) -> None:
    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if int(r["runs"]) > 0]
    speed = {(r["budget"], r["strategy"]): float(r["tok_s_mean"]) for r in rows}
    budgets = sorted({r["budget"] for r in rows}, key=lambda b: float(next(r["budget_mb"] for r in rows if r["budget"] == b)))
    budgets = [b for b in budgets if (b, "balanced") in speed]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.38
    for i, base in enumerate(("attn-first", "ffn-first")):
        ratios = [speed[b, "balanced"] / speed[b, base] if speed.get((b, base)) else 0 for b in budgets]
        ax.bar([x + (i - 0.5) * width for x in range(len(budgets))], ratios, width, label=f"balanced / {base}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(budgets)), budgets)
    ax.set_xlabel("memory budget")
    ax.set_ylabel("speedup")
    ax.set_title(f"{rows[0]['model']}: balanced preservation against the ablations")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
