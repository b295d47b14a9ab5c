#!/usr/bin/env python3
"""Plot scripts/bench_spec.py's CSV.

Figure 1: decode tok/s against the memory budget, one line per configuration (mean over the prompts, their
standard deviation as error bars). Figure 2 (LLMCad Figure 15 style): at one budget (0.8x unless given), each
configuration's tok/s as a bar, the tree and its ablations beside the baselines, with the speedup over the
target streaming alone written on each bar.

    scripts/plot_llmcad.py results/llmcad_qwen.csv FIG1.png [FIG2.png [BUDGET]]
"""

import csv
import statistics
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ("stream", "mmap", "llama-speculative", "auto", "chain", "tree-pipeline", "tree-no-adaptive",
         "tree-no-pacer", "tree")
STYLE = {"stream": dict(color="tab:gray", marker="s"), "mmap": dict(color="black", marker="x", linestyle=":"),
         "llama-speculative": dict(color="tab:orange", marker="^"), "chain": dict(color="tab:green", marker="v"),
         "auto": dict(color="tab:red", marker="D", linestyle="-."),
         "tree": dict(color="tab:blue", marker="o", linewidth=2.2),
         "tree-no-pacer": dict(color="tab:purple", marker=".", linestyle="--"),
         "tree-no-adaptive": dict(color="tab:brown", marker=".", linestyle="--"),
         "tree-pipeline": dict(color="tab:pink", marker=".", linestyle="--")}


def speeds(rows: list[dict]) -> dict:
    """{(budget, config): [tok/s per prompt]} over the evaluation runs that succeeded."""
    out = defaultdict(list)
    for r in rows:
        if r["phase"] == "eval" and not r["error"]:
            out[r["budget"], r["config"]].append(float(r["decode_tok_s"]))
    return out


def _stats(xs):
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _title(rows):
    return f"{rows[0]['model']} + draft {rows[0]['draft_model']}"


def fig_budget(rows: list[dict], ax) -> None:
    s = speeds(rows)
    budget_mb = {r["budget"]: float(r["budget_mb"]) for r in rows}
    configs = [c for c in ORDER if any(k[1] == c for k in s)] + sorted({k[1] for k in s} - set(ORDER))
    for c in configs:
        points = sorted((budget_mb[b], *_stats(v)) for (b, cc), v in s.items() if cc == c)
        x, y, sd = zip(*points)
        ax.errorbar(x, y, yerr=sd, label=c, capsize=3, **STYLE.get(c, {"marker": "o"}))
    budgets = sorted(budget_mb, key=budget_mb.get)
    ax.set_xticks([budget_mb[b] for b in budgets], [f"{b}\n{budget_mb[b]:.0f}" for b in budgets])
    ax.set_xlabel("memory budget (x target size / MiB), enforced by a cgroup")
    ax.set_ylabel("decode tokens/s (mean over prompts)")
    ax.set_title(_title(rows), fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def fig_ablation(rows: list[dict], ax, budget: str = "0.8x") -> None:
    s = speeds(rows)
    configs = [c for c in ORDER if (budget, c) in s]
    if not configs:
        ax.text(0.5, 0.5, f"no run succeeded at {budget}", ha="center", transform=ax.transAxes)
        return
    means, sds = zip(*(_stats(s[budget, c]) for c in configs))
    bars = ax.bar(range(len(configs)), means, yerr=sds, capsize=3,
                  color=[STYLE.get(c, {}).get("color", "tab:blue") for c in configs])
    base = statistics.fmean(s[budget, "stream"]) if (budget, "stream") in s else 0.0
    for bar, m in zip(bars, means):
        if base:
            ax.annotate(f"{m / base:.2f}x", (bar.get_x() + bar.get_width() / 2, m), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(configs)), configs, rotation=30, ha="right")
    ax.set_ylabel("decode tokens/s (mean over prompts)")
    budget_mb = next(float(r["budget_mb"]) for r in rows if r["budget"] == budget)
    ax.set_title(f"at {budget} ({budget_mb:.0f} MiB); labels: speedup over stream\n{_title(rows)}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")


def save(draw, rows: list[dict], png_path: str, *args) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw(rows, ax, *args)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    if len(sys.argv) not in (3, 4, 5):
        sys.exit(__doc__)
    with open(sys.argv[1]) as f:
        table = list(csv.DictReader(f))
    if not any(r["phase"] == "eval" and not r["error"] for r in table):
        sys.exit(f"plot_llmcad: no evaluation run succeeded in {sys.argv[1]}")
    save(fig_budget, table, sys.argv[2])
    if len(sys.argv) >= 4:
        save(fig_ablation, table, sys.argv[3], *sys.argv[4:5])
