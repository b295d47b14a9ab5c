#!/usr/bin/env python3
"""The free drafters' table and figure from bench_freedraft CSVs (issue 30), one CSV a round.

A round is one bench invocation: its systems ran in turn, each prompt cold, with the target alone first. Speeds
are compared within a round only (the disk drifts between rounds): a system's speedup is the geometric mean over
prompts of its tok/s over the target alone's on the same prompt in the same round. llama.cpp's n-gram speculation
(llama-*) is compared with ours through those ratios when they ran in different rounds.

    scripts/plot_freedraft.py OUT_STEM ROUND.csv [ROUND.csv ...]    # OUT_STEM.csv (rows), .md (table), .png
"""

import csv
import math
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

KINDS = ("code", "plain", "edit")


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    stem, rows = Path(sys.argv[1]), []
    for number, path in enumerate(sys.argv[2:], 1):
        for r in csv.DictReader(open(path)):
            r["round"] = str(number)
            rows.append(r)
    ok = [r for r in rows if not r["error"] and float(r["decode_tok_s"] or 0) > 0]
    alone = {(r["round"], r["budget"], r["prompt"]): float(r["decode_tok_s"]) for r in ok if r["system"] == "alone"}
    # (budget, kind, system) -> per-prompt ratios to the target alone, tok/s, tokens per pass, equality
    cells: dict[tuple, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for r in ok:
        key = (r["budget"], r["kind"], r["system"])
        base = alone.get((r["round"], r["budget"], r["prompt"]))
        c = cells[key]
        c["tok_s"].append(float(r["decode_tok_s"]))
        c["per_pass"].append(float(r["tokens_per_pass"] or 0) or 1.0)
        c["same"].append(r["matches_target"] == "yes")
        if base and r["system"] != "alone":
            c["ratio"].append(float(r["decode_tok_s"]) / base)
        c["rounds"].append(r["round"])
    budgets = sorted({k[0] for k in cells})
    systems = list(dict.fromkeys(r["system"] for r in rows))
    llama = [s for s in systems if s.startswith("llama-")]

    with open(Path(f"{stem}.csv"), "w", newline="") as f:
        fields = ["round"] + [k for k in rows[0] if k != "round"]
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)

    lines = ["| budget | prompts | system | tok/s (mean) | tokens a pass | x the target alone | "
             "x llama.cpp's best n-gram | greedy equal | rounds |", "|---|---|---|---:|---:|---:|---:|---|---|"]
    figure: dict[str, dict[str, float]] = defaultdict(dict)
    for budget in budgets:
        for kind in KINDS:
            best_llama = max((geomean(cells[(budget, kind, s)]["ratio"]) for s in llama
                              if (budget, kind, s) in cells and cells[(budget, kind, s)]["ratio"]),
                             default=float("nan"))
            for system in systems:
                c = cells.get((budget, kind, system))
                if not c:
                    continue
                ratio = geomean(c["ratio"]) if c["ratio"] else (1.0 if system == "alone" else float("nan"))
                vs = ratio / best_llama if not system.startswith("llama-") and system != "alone" else float("nan")
                n = len(c["tok_s"])
                lines.append(f"| {budget} | {kind} ({n}) | {system} | {sum(c['tok_s']) / n:.2f} | "
                             f"{sum(c['per_pass']) / n:.2f} | {ratio:.2f}x | "
                             f"{'' if math.isnan(vs) else f'{vs:.2f}x'} | {sum(c['same'])}/{n} | "
                             f"{','.join(sorted(set(c['rounds'])))} |")
                if system != "alone":
                    figure[f"{budget} {system}"][kind] = ratio
    Path(f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    fig, ax = plt.subplots(figsize=(11, 4.5))
    names = list(figure)
    width = 0.8 / len(KINDS)
    for i, kind in enumerate(KINDS):
        ax.bar([j + i * width for j in range(len(names))], [figure[n].get(kind, 0) for n in names], width, label=kind)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + width for j in range(len(names))], names, rotation=40, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decode speed / the target alone (geo. mean)")
    ax.set_title("Qwen2.5-Coder-1.5B streamed under a cgroup budget: speculation without a draft model")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(f"{stem}.png"), dpi=120)


if __name__ == "__main__":
    main()
