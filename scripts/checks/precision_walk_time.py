#!/usr/bin/env python3
"""How long precision's walk (mixed.search: a residency plan at every step) takes on the real 1.5B at 0.6x, with a
sensitivity table of the 1.5B's groups and candidate types (random harms: the walk's length, not its choice)."""
import random
import time

from flexoffload.gguf import catalog
from flexoffload.gguf.model import load
from flexoffload.measure import probe, profiler, sensitivity
from flexoffload.memory import budgets
from flexoffload.plan import mixed, qtypes

m = load(catalog.resolve("qwen2.5-coder-1.5b-instruct"))
rng = random.Random(0)
rows = []
for g in sensitivity.groups(m):
    for ty in sensitivity.group_candidates(m, g):
        saved = sum(t.n_bytes - qtypes.tensor_bytes(t, ty) for t in m.tensors if t.name in g.tensors)
        rows.append(qtypes.Row(g.name, g.kind, g.first, g.last, g.type, ty, list(g.tensors), saved, rng.random() * 0.01,
                               0.0, 0.0, 0.0, 0.0, 0.0, 1.0))
sens = qtypes.Sensitivity(str(m.path), sensitivity.N_GROUPS, list(qtypes.LADDER), 0.0, 0.0, rows)
budget = budgets.parse_size("0.6x", m.file_size)
prof = profiler.measure(m, 2)
run = probe.measure(m, 2048, 512)
t = time.perf_counter()
w = mixed.search(m, budget, sens, prof, run)
print(f"{len(rows)} rows, {len(w.points)} points of the walk, {len(w.alternatives)} alternatives: "
      f"{time.perf_counter() - t:.1f} s")
