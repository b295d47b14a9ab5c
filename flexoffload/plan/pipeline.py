"""The read/compute pipeline of one decoded token, simulated (costmodel.py builds its stages from a model and a
profile): stages in order, each computing once the previous one has and its streamed tensors are in; reads run one
stage after another, at most `window` stages ahead of compute. The recurrence is run over a few tokens until the
time per token is steady (costmodel.py's docstring says why, and what it simplifies)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """One step of the pipeline: its compute, and the reads it waits for."""

    name: str  # "token_embd", "blk.3", "output"
    compute_s: float
    read_s: float
    streamed_bytes: int  # bytes a pass reads for it
    n_streamed: int
    held_bytes: int | None = None  # read buffers its streamed tensors hold at once (chunked: a few chunks); None:
    # streamed_bytes
    late_read_s: float = 0.0  # chunks beyond those held: read while the stage computes, not ahead

    def __post_init__(self):
        if self.held_bytes is None:
            object.__setattr__(self, "held_bytes", self.streamed_bytes)


@dataclass(frozen=True)
class StageTime:
    """A stage in the steady-state token, times in seconds from the end of the previous token's compute.

    Read times can be negative: a stage's reads may start while the previous token still computes.
    """

    stage: Stage
    read_start: float
    read_end: float
    compute_start: float
    compute_end: float
    stall_s: float  # how long compute, done with the previous stage, waited for this stage's reads


@dataclass(frozen=True)
class Prediction:
    seconds_per_token: float
    stages: tuple[StageTime, ...]  # the per-stage breakdown of one steady-state token

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds_per_token

    @property
    def compute_s(self) -> float:
        return sum(s.stage.compute_s for s in self.stages)

    @property
    def read_s(self) -> float:
        return sum(s.stage.read_s + s.stage.late_read_s for s in self.stages)


def simulate(stages: list[Stage], window: int, max_tokens: int = 64) -> Prediction:
    """Steady-state seconds per token of the read/compute pipeline over `stages` with a prefetch window.

    read_end[g] = max(read_end[g-1], compute_end[q-1]) + read[g]
    compute_end[g] = max(compute_end[g-1], read_end[g]) + compute[g]
    over global stage index g (token * len(stages) + stage), from an empty start, where q is the stage `window`
    streaming stages before g (the runtime's window counts only stages that stream); a stage with late reads (the
    chunks of a chunked tensor beyond those it holds) reads them from its compute's start, and computes until
    both are done. It is a max-plus linear
    recurrence, so the time per token becomes periodic after a transient: simulation stops when the last tokens
    repeat (period up to 4) and otherwise averages the second half of max_tokens.
    """
    if window < 0:
        raise ValueError(f"window must be >= 0, not {window}")
    n = len(stages)
    read = [s.read_s for s in stages]
    late = [s.late_read_s for s in stages]
    comp = [s.compute_s for s in stages]
    # the runtime's ring holds only the stages that stream, and its window counts those (patch 0002, sched.cpp):
    # a stage is queued when compute reaches the streaming stage `window` before it in the ring
    ring = [s for s in range(n) if stages[s].n_streamed]
    position = {s: p for p, s in enumerate(ring)}
    window = min(window, max(len(ring) - 1, 0))
    read_start, read_end, comp_start, comp_end, stall = [], [], [], [], []
    ends = [0.0]  # compute end of each token
    r_prev = c_prev = 0.0
    seconds = None
    for token in range(max_tokens):
        for s in range(n):
            if s in position:
                turn, p = divmod(position[s] - window, len(ring))
                slot = (token + turn) * n + ring[p] - 1  # the stage before the one whose compute queues s
            else:
                slot = -1  # reads nothing
            start = max(r_prev, comp_end[slot] if slot >= 0 else 0.0)
            r_prev = start + read[s]
            c0 = max(c_prev, r_prev)
            stall.append(c0 - c_prev)
            c_prev = c0 + comp[s]
            if late[s]:
                r_prev = c0 + late[s]
                c_prev = max(c_prev, r_prev)
            read_start.append(start)
            read_end.append(r_prev)
            comp_start.append(c0)
            comp_end.append(c_prev)
        ends.append(c_prev)
        seconds = _steady(ends)
        if seconds is not None:
            break
    if seconds is None:
        half = max_tokens // 2
        seconds = (ends[-1] - ends[-1 - half]) / half
    t0, first = ends[-2], len(comp_end) - n
    breakdown = tuple(
        StageTime(stages[s], read_start[first + s] - t0, read_end[first + s] - t0,
                  comp_start[first + s] - t0, comp_end[first + s] - t0, stall[first + s])
        for s in range(n))
    return Prediction(seconds, breakdown)


def _steady(ends: list[float], max_period: int = 4) -> float | None:
    """Seconds per token if the per-token durations have become periodic, else None."""
    d = [b - a for a, b in zip(ends, ends[1:])]
    for p in range(1, max_period + 1):
        if len(d) >= 2 * p + 1 and all(math.isclose(d[-i], d[-i - p], rel_tol=1e-12, abs_tol=1e-15)
                                       for i in range(1, p + 1)):
            return sum(d[-p:]) / p
    return None
