"""Ours, the default: of many candidate resident sets, the one the cost model predicts fastest.

Why this shape: while the disk is the bottleneck every streamed byte costs 1/bandwidth whichever tensor it is, so
a plan wins by (a) filling the memory tightly, its window included, and (b) keeping each layer's reads in
proportion to the compute they can hide behind, so that a small window never makes reads wait for compute or
compute wait for reads (FlexInfer's balanced memory locking, judged by the cost model instead of by equal bytes).

The candidates: for every subset of the layer kinds (q, k, v, output, gate, up, down) that fits whole across all
layers (balanced by construction), the memory left is filled tensor by tensor: again and again the layer whose
reads are longest relative to its cover (the compute of the window's stages before it, during which its reads
run) keeps one more tensor, until nothing fits. Four fills per subset: keeping the largest tensor of the layer
that fits (tight, coarse steps) or the smallest (spares read requests, and completes rounds over all layers,
which is when the window shrinks); each from the subset as it is, and after first keeping the tensors that shrink
the window (`_trim`: next to a streamed token_embd or output). Layers tied are visited in an order spread over
the model, so a partial kind does not pile up in neighbouring layers. Every candidate is simulated.

Where token_embd is resident, every fill is also made from the same start with it streamed: the runtime reads only
the rows a pass looks up, so streaming it costs a small read a token and gives nearly all its bytes to the layers.
Likewise where the output matrix is resident and large enough to stream in chunks (costmodel.held_bytes): from a
start with it (and token_embd) streamed, it holds a few chunks of window instead of itself. That plan is taken
only where it is predicted faster by OUTPUT_MARGIN: streamed, the output measured slower than predicted.

The paper's heuristics are candidates too, so this never predicts slower than any of them at the same capacity.
Without them, on the 1.5B and a 7B-shaped table over windows 0-8 and 20-105% of the weights, the fills alone are
ahead or equal in 199 of 209 cases and at most 1.2% behind in the rest (the tensor sizes of the mixed Q4_K/Q6_K
layers packing a little better in another order). A plan of the 1.5B takes 0.05-2.5 s (the streamed-output starts
double the fills where the output is resident).
"""

from __future__ import annotations

import heapq
from itertools import combinations

from flexoffload.gguf.model import Model, Tensor
from flexoffload.plan.costmodel import Pipeline, Profile
from flexoffload.plan.planners.baselines import BASELINES
from flexoffload.plan.planners.common import Ledger, base, layer_pool

# How much faster the cost model must predict a plan that streams an output matrix the budget could keep, to take
# it. Measured on the 1.5B (scripts/checks/compare_plans.py: one process, plans in turn,
# results/plans_qwen1.5b_0*x.csv):
# at 0.5x, output streamed 1.78 tok/s mean over 4 runs, kept 2.35, where the model predicted 3% for streaming it;
# at 0.7x, 1.95 against 3.13 over 3 (predicted 3% for streaming). The chunks it cannot read ahead
# (pipeline.Stage.late_read_s) explain only part of that.
OUTPUT_MARGIN = 0.10


def plan(model: Model, capacity: int, profile: Profile, window: int, io_threads: int) -> set[str]:
    ledger = base(model, capacity, window)
    pipe = Pipeline(model, profile, io_threads)
    candidates = _fills(model, pipe, ledger, window)
    by_rows = {name for name in pipe.rows if name in ledger.resident and name not in pipe.tied}
    if by_rows and capacity < model.weight_bytes:  # something streams: try token_embd streamed by rows too
        candidates += _fills(model, pipe, Ledger(model, ledger.resident - by_rows, capacity, window), window)
    candidates += [policy(model, capacity, profile, window, io_threads) for policy in BASELINES.values()]
    sizes = {t.name: t.n_bytes for t in model.tensors}

    def best(sets):
        unique = {frozenset(r): r for r in sets}.values()
        return min(unique, key=lambda r: (pipe.seconds(r, window), -sum(sizes[n] for n in r)))

    kept = best(candidates)
    # a resident output matrix that streams in chunks holds only a few of them in window: try it streamed too,
    # and take that only where the cost model says it pays by OUTPUT_MARGIN
    chunked = {t.name for t in model.tensors if (t.kind == "output" or t.name in pipe.tied)
               and t.name in ledger.resident and pipe.held[t.name] < t.n_bytes}
    if not chunked or capacity >= model.weight_bytes:
        return kept
    streamed = best(_fills(model, pipe, Ledger(model, ledger.resident - by_rows - chunked, capacity, window), window))
    if pipe.seconds(streamed, window) * (1 + OUTPUT_MARGIN) < pipe.seconds(kept, window):
        return streamed
    return kept


def _fills(model: Model, pipe: Pipeline, ledger: Ledger, window: int) -> list[set[str]]:
    """The candidates from one start: for every subset of the kinds that fits whole, four fills."""
    pool = layer_pool(model, ledger.resident)
    kinds: dict[str, list[Tensor]] = {}
    for t in pool:
        kinds.setdefault(t.kind, []).append(t)
    candidates = []
    for n in range(len(kinds) + 1):
        for chosen in combinations(kinds, n):
            whole = [t for k in chosen for t in kinds[k]]
            if ledger.fits(whole):
                rest = [t for t in pool if t.kind not in chosen]
                start = ledger.copy()
                start.add(whole)
                trimmed = start.copy()
                _trim(trimmed, rest)
                starts = (start, trimmed) if trimmed.resident != start.resident else (start,)
                candidates += [_fill(pipe, s.copy(), rest, window, prefer)
                               for s in starts for prefer in (_largest, _smallest)]
    return candidates


def _trim(ledger: Ledger, streamed: list[Tensor]) -> None:
    """First keep tensors that shrink the window: in the stages that set it (e.g. next to a streamed output read
    whole, whose buffers dominate it), a resident tensor also gives back window memory. Most given back per
    byte first, while any gives back something."""
    while True:
        stages = ledger.window_stages()
        best, best_gain = None, 0.0
        for t in streamed:
            if t.name not in ledger.resident and ledger.stage[t.name] in stages and ledger.fits([t]):
                gain = ledger.shrink(t) / t.n_bytes
                if gain > best_gain:
                    best, best_gain = t, gain
        if best is None:
            return
        ledger.add([best])


def _largest(pipe: Pipeline, n_streamed: int, fitting: list[Tensor]) -> Tensor:
    """The largest: fills the capacity in the fewest, coarsest steps."""
    return max(fitting, key=lambda t: t.n_bytes)


def _smallest(pipe: Pipeline, n_streamed: int, fitting: list[Tensor]) -> Tensor:
    """The smallest: every byte kept saves the same read time, but when keeping any one spares a round of read
    requests the smallest saves most per byte; and fine steps let rounds over all layers complete, which is
    when the window shrinks."""
    return min(fitting, key=lambda t: t.n_bytes)


def _cover(pipe: Pipeline, resident: set[str], window: int) -> dict[str, float]:
    """Per stage, the compute its reads can hide behind: that of the `window` stages before it (its reads start
    when the stage before those is done and must end before it computes); its own with window 0."""
    stages = pipe.stages(resident)
    n = len(stages)
    return {s.name: (sum(stages[(i - j) % n].compute_s for j in range(1, min(window, n - 1) + 1)) if window
                     else s.compute_s) or 1e-12 for i, s in enumerate(stages)}


def _fill(pipe: Pipeline, ledger: Ledger, streamed: list[Tensor], window: int, prefer) -> set[str]:
    """Keep streamed layer tensors while they fit, each time in the layer whose reads are longest relative to
    the compute they can hide behind, the tensor of it that `prefer` picks among those that fit; then any that
    fit once the window has shrunk."""
    cover = _cover(pipe, ledger.resident, window)
    rank = {layer: i for i, layer in enumerate(_spread(pipe.n_layer))}

    def read(n_bytes: int, n_streamed: int) -> float:
        return pipe.profile.read_seconds(n_bytes, n_streamed, pipe.io_threads)

    layers: dict[int, list] = {}  # layer -> [streamed bytes, its tensors]
    for t in streamed:
        layers.setdefault(t.layer, [0, []])
        layers[t.layer][0] += t.n_bytes
        layers[t.layer][1].append(t)

    def key(layer: int) -> tuple[float, int, int]:
        n_bytes, ts = layers[layer]
        return -read(n_bytes, len(ts)) / cover[f"blk.{layer}"], rank[layer], layer

    heap = [key(layer) for layer in layers]
    heapq.heapify(heap)
    while heap:
        layer = heapq.heappop(heap)[2]
        n_bytes, ts = layers[layer]
        fitting = [t for t in ts if ledger.fits([t])]
        if not fitting:
            continue
        t = prefer(pipe, len(ts), fitting)
        ledger.add([t])
        ts.remove(t)
        layers[layer][0] -= t.n_bytes
        if ts:
            heapq.heappush(heap, key(layer))
    return ledger.take(sorted(streamed, key=lambda t: -t.n_bytes)).resident


def _spread(n: int) -> list[int]:
    """0..n-1 in an order whose every prefix is spread over the range (van der Corput), so ties between layers
    do not pile the resident tensors into neighbouring layers."""
    order, seen, bits = [], set(), max(1, (n - 1).bit_length() + 1)
    for i in range(1 << bits):
        x = int(f"{i:0{bits}b}"[::-1], 2) / (1 << bits)
        layer = int(x * n)
        if layer not in seen:
            seen.add(layer)
            order.append(layer)
    return order + [i for i in range(n) if i not in seen]
