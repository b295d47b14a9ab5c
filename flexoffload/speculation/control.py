"""The measured decision of a speculating run (Controller): how deep the draft's tree goes and whether the draft model
drafts at all, pass by pass, from what the run itself has measured.

What it measures: the chance the target accepts the draft's top token at each depth given it accepted the node above
(`accepted` / `reached` by depth, decayed so a run's later passes weigh more), the same for the draft's other candidates
(`side`), the same by the probability the draft gave the token (`prob_accepted` / `prob_reached`, by tenths: how far the
draft's confidence can be trusted, as EAGLE-2 and llama.cpp's p_min trust it), the seconds of a draft step, and the
target's pass as a line in its rows (a one-token pass plus a cost a further row, fitted by least squares over the run's
passes, anchored by the plan's prediction until passes of several sizes are in). From these, a chain of depth d yields
E(d) = 1 + sum_k prod_{i<=k} a_i tokens a pass (Leviathan et al.) in T(d) = pass(1 + d) + d * draft_step + overhead
seconds, and the target alone one token in pass(1) + overhead. A node is drafted while its path's chance pays for what
it adds (Sequoia's rule, as SpecExec trims: P(v) >= dt(v) * R, R the best rate the model finds); a drafted node's chance
is its parent's times the measured acceptance at the draft's probability for it, so a chain goes on while the draft is
sure of each token and stops at the first it is not (the depths' mean rates alone cut every chain at the same length),
and a leaf that does not pay for its row is left out of the pass. Where no depth beats the target alone the draft is
off; every PROBE passes it drafts once more (at the depth it would choose if on), so a run whose text turns predictable
turns it back on.

Pure Python, no llama.cpp: speculate.py feeds it each pass's measurements and asks it before drafting; the API uses
`predicted_tok_s` to decide a run's memory before loading, from a stored history (`Measured.to_json`) or the prior.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.95  # an observation's weight against the next one's, per observation at the same depth
PRIOR_ACCEPT = 0.8  # the draft's top token accepted given its parent, before anything is measured
PRIOR_WEIGHT = 2.0  # pseudo-observations behind a prior (and behind the pooled rate at a depth seldom reached)
SIDE_PRIOR = (0.5, 2.0)  # a side candidate accepted given its parent was, (accepted, reached) before measuring
PROBE = 8  # passes between probes while the draft is off
PROBE_DEPTH = 4  # a probe drafts at least this deep
PROBE_P = 0.3  # and on while its path is this likely
BINS = 10  # the draft's probability of a token, in tenths, by which acceptance is measured
MAX_DEPTH = 47  # the deepest a chain goes (the target's logits rows, spectree.MAX_NODES, less the root)
HISTORY_WEIGHT = 8.0  # a stored history's counts are scaled to at most this many observations a depth


def _tenth(prob: float) -> int:
    """The bin of a draft's probability for a token (BINS of them)."""
    return min(int(prob * BINS), BINS - 1)


@dataclass
class Measured:
    """What a run measured (and a history keeps): decayed acceptance by depth of the draft's top tokens, of its
    side candidates, of any token by the probability the draft gave it, the draft step's seconds, and the target
    pass's fit."""
    accepted: list[float] = field(default_factory=list)  # index d-1: depth d
    reached: list[float] = field(default_factory=list)
    side: list[float] = field(default_factory=lambda: list(SIDE_PRIOR))
    draft_step_s: float | None = None
    row_s: float | None = None  # what a row past the first adds to a target pass
    overhead_s: float = 0.0  # a pass's seconds outside the draft and the target (bookkeeping)
    passes: int = 0
    # what speculating made of the run: its tokens a second over a one-token pass's rate in the same memory (the
    # draft's beside the target), averaged over the runs kept; None: not measured. What the next run's memory
    # decision scales its plan's one-token pass by (predicted_tok_s): robust to the disk's drift, as a ratio is
    gain: float | None = None
    # any rank's acceptance given its parent's, by the tenth of the probability the draft gave the token
    prob_accepted: list[float] = field(default_factory=lambda: [0.0] * BINS)
    prob_reached: list[float] = field(default_factory=lambda: [0.0] * BINS)

    def pooled(self) -> float:
        """The chance the draft's top token is accepted given its parent was, at any depth."""
        return (sum(self.accepted) + PRIOR_ACCEPT * PRIOR_WEIGHT) / (sum(self.reached) + PRIOR_WEIGHT)

    def rate(self, depth: int) -> float:
        """The chance the draft's top token at depth (1 = the root's child) is accepted given its parent was:
        measured at that depth, pulled toward the pooled rate where it was seldom reached."""
        pooled = self.pooled()
        if depth > len(self.reached):
            return pooled
        return (self.accepted[depth - 1] + pooled * PRIOR_WEIGHT) / (self.reached[depth - 1] + PRIOR_WEIGHT)

    def side_rate(self) -> float:
        return self.side[0] / self.side[1]

    def prob_rate(self, prob: float, prior: float | None = None) -> float:
        """The chance the target accepts a drafted token the draft gave probability prob, given it accepted the
        token's parent: measured in prob's tenth, pulled toward prior (the rate by the token's depth or rank; None:
        the pooled rate) where that tenth was seldom seen. A draft's probabilities are not taken on trust: a
        random-weight draft that is its target gives every token a few percent, and is always right."""
        b = _tenth(prob)
        prior = self.pooled() if prior is None else prior
        return (self.prob_accepted[b] + prior * PRIOR_WEIGHT) / (self.prob_reached[b] + PRIOR_WEIGHT)

    def to_json(self) -> dict:
        return {"accepted": [round(x, 3) for x in self.accepted], "reached": [round(x, 3) for x in self.reached],
                "side": [round(x, 3) for x in self.side], "prob_accepted": [round(x, 3) for x in self.prob_accepted],
                "prob_reached": [round(x, 3) for x in self.prob_reached], "draft_step_s": self.draft_step_s,
                "row_s": self.row_s, "overhead_s": self.overhead_s, "passes": self.passes, "gain": self.gain}

    @classmethod
    def from_json(cls, d: dict) -> "Measured":
        """A stored history, its counts scaled to at most HISTORY_WEIGHT observations a depth (a run's own passes
        soon outweigh it). ValueError, KeyError or TypeError where it is not one."""
        accepted, reached = [float(x) for x in d["accepted"]], [float(x) for x in d["reached"]]
        if len(accepted) != len(reached) or any(not 0 <= a <= n for a, n in zip(accepted, reached)):
            raise ValueError("acceptance counts out of range")
        scale = min(1.0, HISTORY_WEIGHT / max(reached, default=1.0)) if reached else 1.0
        side = [float(x) for x in d["side"]]
        if len(side) != 2 or not 0 <= side[0] <= side[1] or side[1] <= 0:
            raise ValueError("side counts out of range")
        step, row, gain = d.get("draft_step_s"), d.get("row_s"), d.get("gain")
        if gain is not None and not 0 < float(gain) < 100:
            raise ValueError("gain out of range")
        # a history from before the acceptance by probability was kept has none: the prior's
        p_acc = [float(x) for x in d.get("prob_accepted", [0.0] * BINS)]
        p_reach = [float(x) for x in d.get("prob_reached", [0.0] * BINS)]
        if len(p_acc) != BINS or len(p_reach) != BINS or any(not 0 <= a <= n for a, n in zip(p_acc, p_reach)):
            raise ValueError("acceptance counts by probability out of range")
        p_scale = min(1.0, HISTORY_WEIGHT / max(max(p_reach), 1e-9))
        return cls([a * scale for a in accepted], [n * scale for n in reached],
                   [side[0] * min(1.0, HISTORY_WEIGHT / side[1]), side[1] * min(1.0, HISTORY_WEIGHT / side[1])],
                   float(step) if step is not None else None, float(row) if row is not None else None,
                   float(d.get("overhead_s", 0.0)), int(d.get("passes", 0)),
                   float(gain) if gain is not None else None,
                   [a * p_scale for a in p_acc], [n * p_scale for n in p_reach])


def chain_yield(m: Measured, depth: int) -> float:
    """Tokens a pass verifying a chain of depth draft tokens yields: the target's own, and each drafted token whose
    path the target accepts."""
    total, p = 1.0, 1.0
    for d in range(1, depth + 1):
        p *= m.rate(d)
        total += p
    return total


def best_depth(m: Measured, pass_s: float, row_s: float, step_s: float, overhead_s: float = 0.0,
               max_depth: int = MAX_DEPTH) -> tuple[int, float]:
    """The chain depth whose pass yields the most tokens a second, and that rate; depth 0 is the target alone
    (one token in pass_s + overhead_s)."""
    best, best_rate = 0, 1.0 / max(pass_s + overhead_s, 1e-6)
    total, p = 1.0, 1.0
    for d in range(1, max_depth + 1):
        p *= m.rate(d)
        total += p
        rate = total / (pass_s + d * (row_s + step_s) + overhead_s)
        if rate > best_rate:
            best, best_rate = d, rate
    return best, best_rate


def predicted_tok_s(m: Measured, pass_s: float, row_s: float, step_s: float) -> float:
    """The decode speed a run speculating with this draft can be expected to reach, before loading: where runs of
    the pair measured it, their gain over the one-token pass of the plan (pass_s); else the best chain depth by the
    prior acceptance, a row's compute (row_s) and a draft step (step_s) by the cost model unless measured."""
    if m.gain is not None:
        return m.gain / pass_s
    return best_depth(m, pass_s, m.row_s if m.row_s is not None else row_s,
                      m.draft_step_s if m.draft_step_s is not None else step_s, m.overhead_s)[1]


class Controller:
    """A speculating run's measured decision. pass_s: the plan's predicted one-token pass; row_s: the cost model's
    seconds a further row adds; step_s: a draft step's predicted seconds (None: unknown until one is measured);
    measured: a history to start from (None: the prior); always: never turn the draft off (--draft-always)."""

    def __init__(self, pass_s: float | None, row_s: float, step_s: float | None = None,
                 measured: Measured | None = None, always: bool = False, max_depth: int = MAX_DEPTH):
        self.m = measured or Measured()
        self.always, self.max_depth = always, max_depth
        self.step_s = self.m.draft_step_s if self.m.draft_step_s is not None else step_s
        # the pass's line, as weighted sums over (rows - 1, seconds); two anchors from the plan and the cost model,
        # each of weight 1, that the run's passes soon outweigh
        self.fit = [0.0] * 5  # sum w, w x, w y, w x x, w x y
        row = self.m.row_s if self.m.row_s is not None else row_s
        if pass_s:
            for x in (0.0, 16.0):
                self._add(x, pass_s + x * row, 1.0)
        self.off_passes = 0  # passes since the draft last drafted
        self.on = True
        self.n_off = 0  # passes run with the draft off (for the result)
        self.tokens, self.seconds = 0, 0.0  # the run's passes: what they gave, and took
        self.planned: tuple[int, float] | None = None  # plan()'s answer until the next measurement
        self.stored_gain = self.m.gain

    def _add(self, x: float, y: float, w: float) -> None:
        f = self.fit
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            f[i] += v

    def line(self) -> tuple[float, float]:
        """The target pass's seconds for one row, and what each further row adds (never below 0)."""
        w, sx, sy, sxx, sxy = self.fit
        if w <= 0:
            return 0.0, 0.0
        var = sxx - sx * sx / w
        slope = max((sxy - sx * sy / w) / var, 0.0) if var > 1e-9 else 0.0
        return max((sy - slope * sx) / w, 1e-4), slope

    def _unmeasured(self) -> bool:
        """No draft step, or no target pass, measured or predicted yet: nothing to weigh a node against."""
        return self.step_s is None or self.fit[0] <= 0

    def plan(self) -> tuple[int, float]:
        """The best chain depth (0: the target alone) and the rate it gives by what is measured so far; worked out
        once a pass (the draft asks for every node), again after the pass's measurements."""
        if self._unmeasured():  # draft, and measure
            return self.max_depth, 0.0
        if self.planned is None:
            pass_s, row_s = self.line()
            self.planned = best_depth(self.m, pass_s, row_s, self.step_s, self.m.overhead_s, self.max_depth)
        return self.planned

    def draft_on(self) -> bool:
        """Whether the draft model drafts this pass: where some depth beats the target alone, or to probe once
        every PROBE passes off."""
        depth, _ = self.plan()
        if depth > 0 or self.always:
            self.on, self.off_passes = True, 0
            return True
        self.off_passes += 1
        self.on = self.off_passes >= PROBE
        if self.on:
            self.off_passes = 0
        else:
            self.n_off += 1
        return self.on

    def pays(self, p_path: float, depth: int) -> bool:
        """Whether a draft node at depth whose path the target accepts with chance p_path (the product of the
        measured rates down to it) pays for a draft step and a row: p_path >= (step + row) * R, R the best rate
        found. A probe (no depth pays) drafts PROBE_DEPTH nodes, and on while the path stays likely (PROBE_P)."""
        if self._unmeasured():
            return depth <= PROBE_DEPTH or p_path >= PROBE_P  # the first pass: a chain, to measure it
        best, rate = self.plan()
        if best == 0:
            return depth <= PROBE_DEPTH or p_path >= PROBE_P
        return p_path >= (self.step_s + self.line()[1]) * rate

    def keeps(self, p_path: float) -> bool:
        """Whether a drafted leaf whose path the target accepts with chance p_path pays for its row in the pass (its
        draft step is spent already): p_path >= row * R. A probe, or a run that has measured nothing, keeps it."""
        if self._unmeasured():
            return True
        best, rate = self.plan()
        return best == 0 or p_path >= self.line()[1] * rate

    # --- what a pass measured -----------------------------------------------------------------------------------

    def observe_node(self, depth: int, rank: int, accepted: bool, prob: float | None = None) -> None:
        """A draft node the target verified whose parent it accepted: its depth below the root, its rank among its
        parent's candidates (0: the draft's top token), whether the target accepted it, and the probability the
        draft gave it (None: not known)."""
        m = self.m
        self.planned = None
        if prob is not None:
            b = _tenth(prob)
            m.prob_accepted[b] = m.prob_accepted[b] * DECAY + accepted
            m.prob_reached[b] = m.prob_reached[b] * DECAY + 1
        if rank > 0:
            m.side[0] = m.side[0] * DECAY + accepted
            m.side[1] = m.side[1] * DECAY + 1
            return
        while len(m.reached) < depth:
            m.accepted.append(0.0)
            m.reached.append(0.0)
        m.accepted[depth - 1] = m.accepted[depth - 1] * DECAY + accepted
        m.reached[depth - 1] = m.reached[depth - 1] * DECAY + 1

    def observe_pass(self, rows: int, target_s: float, steps: int, draft_s: float, overhead_s: float,
                     tokens: int = 1) -> None:
        """One verification: the target's pass over rows rows took target_s and gave tokens; steps draft steps took
        draft_s; the rest of the pass's wall time (bookkeeping) overhead_s."""
        m = self.m
        self.planned = None
        m.passes += 1
        self.tokens += tokens
        self.seconds += target_s + draft_s + overhead_s
        w = self.fit
        # earlier passes fade, so the line follows the disk's drift
        for i in range(5):
            w[i] *= DECAY
        self._add(float(rows - 1), target_s, 1.0)
        m.row_s = self.line()[1]
        if steps:
            s = draft_s / steps
            self.step_s = s if self.step_s is None else 0.7 * self.step_s + 0.3 * s
            m.draft_step_s = self.step_s
        m.overhead_s = overhead_s if m.passes == 1 else 0.8 * m.overhead_s + 0.2 * overhead_s

    def measured(self) -> Measured:
        """What to keep of the run (history.py): its measurements, and the gain it made averaged with the one it
        started from (a run of a few passes says little alone)."""
        if self.tokens and self.seconds:
            pass_s, _ = self.line()
            run = self.tokens / self.seconds * (pass_s + self.m.overhead_s)
            self.m.gain = run if self.stored_gain is None else 0.5 * (self.stored_gain + run)
        return self.m

    def summary(self) -> dict:
        """What the run measured and decided, for its result (and the user's --json)."""
        pass_s, row_s = self.line()
        depth, rate = self.plan()
        m = self.m
        return {"acceptance_by_depth": [round(m.rate(d), 3) for d in range(1, len(m.reached) + 1)],
                "reached_by_depth": [round(x, 2) for x in m.reached], "side_rate": round(m.side_rate(), 3),
                "acceptance_by_prob": [round(m.prob_rate((b + 0.5) / BINS), 3) for b in range(BINS)],
                "reached_by_prob": [round(x, 2) for x in m.prob_reached],
                "draft_step_s": self.step_s, "pass_s": pass_s, "row_s": row_s, "overhead_s": m.overhead_s,
                "depth": depth, "predicted_tok_s": rate, "draft_off_passes": self.n_off, "passes": m.passes,
                "tok_s": self.tokens / self.seconds if self.seconds else 0.0}
