"""The default placement: the one the cost model predicts fastest, across the three tiers.

Candidates are llama.cpp's layer assignments (-ngl with any split of the trailing layers among the devices,
the output head on its device or kept on the host by an override: its logits then need not cross the link), and
the placements of the other policies (layers, split, oato), so the choice is checked against them. Each is ranked
by a quick estimate (Problem.quick); the host's tier (what stays resident there, what streams) is planned for the
best few, and the one predicted fastest wins (a near tie goes to the one streaming least: TIE). Contiguous layers keep the graph's visits to a device to one a
token: on a link every visit costs round trips, which is why per-operator placement loses over RPC.
"""

from __future__ import annotations

from flexoffload.plan.placement import Placement, device_bytes, head_home
from flexoffload.plan.placers import layers, oato, split
from flexoffload.plan.placers.common import Problem, evaluate, layer_counts
from flexoffload.plan.plans import streamed_bytes

FINALISTS = 4  # candidates whose host tier is planned in full
# Predictions closer than this are a tie: the one streaming least from the host's disk wins (the cost model's reads
# are its least certain part: runs read slower than the profile's disk), then the one visiting the devices least,
# then the one using the devices' memory most (llama.cpp's -ngl where nothing else is predicted faster). Measured
# before this rule: at 50 % on the device, -ngl 11 was predicted 0.1 % faster than -ngl 14 (the device computes
# 0.8 % slower) and measured 2.5 % slower, within noise; at 75 %, a layout streaming 22 MiB was predicted 0.1 %
# faster and measured 9 % slower (results/oato_rpc_qwen1.5b_first.csv).
TIE = 0.01
MAX_SPLIT_DEVICES = 3  # beyond, the splits of the layers are too many to enumerate


def candidates(problem: Problem) -> list[Placement]:
    """Every -ngl with every split of its layers among the devices (with more than MAX_SPLIT_DEVICES, only the split
    in proportion to their budgets), each with the output head where the assignment puts it or kept home."""
    model, names = problem.model, problem.names
    out = [Placement("auto", names, 0)]
    for n in range(1, model.n_layer + 2):
        if len(names) <= MAX_SPLIT_DEVICES:
            splits = layer_counts(n, len(names))
        else:
            splits = [[b / sum(problem.budgets) * n for b in problem.budgets]]
        for counts in splits:
            split = tuple(float(c) for c in counts) if len(names) > 1 else ()
            out += [Placement("auto", names, n, split), Placement("auto", names, n, split, head_home(model))]
    return out


def place(problem: Problem) -> Placement:
    pool = [p for p in candidates(problem) if problem.fits(p)]
    pool.sort(key=problem.quick)
    others = [f(problem) for f in (layers.place, split.place, oato.place)]
    finalists = pool[:FINALISTS] + [p for p in others if problem.fits(p)]
    scored = []
    for p in finalists:
        host, cost = evaluate(problem, p)
        on_devices = sum(device_bytes(problem.model, p, problem.kv_cache, problem.compute))
        scored.append((cost.seconds_per_token, streamed_bytes(host, problem.model), cost.visits, -on_devices, p))
    fastest = min(s[0] for s in scored)
    ties = [s for s in scored if s[0] <= fastest * (1 + TIE)]
    best = min(ties, key=lambda s: s[1:4])[4]
    return Placement("auto", best.devices, best.n_gpu_layers, best.tensor_split, best.placed)
