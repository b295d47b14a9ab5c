"""The measured decision of a speculating run (speculation/control.py) and its history (speculation/history.py), without
llama.cpp: acceptances and timings forced, the decisions checked."""

import json

import pytest

from flexoffload.speculation import history, control as speccontrol
from flexoffload.speculation.control import PROBE, PROBE_DEPTH, Controller, Measured
from flexoffload.speculation.grow import TreeGrower
from flexoffload.speculation.state import _Call
from flexoffload.speculation.tree import Node, Options, Tree

STEP, ROW, PASS = 0.03, 0.02, 0.5  # a draft step, a target row, a streamed one-token pass (seconds)


def _measured(rate: float, depth: int = 24, weight: float = 50.0) -> Measured:
    return Measured([rate * weight] * depth, [weight] * depth)


def _feed(control: Controller, rate: float, passes: int, rows: int = 9) -> list[bool]:
    """passes passes in which the draft's top tokens are accepted at `rate` at every depth (as counts of a
    deterministic pattern), the target's pass following the line PASS + ROW a row; whether the draft drafted."""
    on = []
    for i in range(passes):
        drafting = control.draft_on()
        on.append(drafting)
        if drafting:
            for depth in range(1, rows):
                control.observe_node(depth, 0, (i * rows + depth) % 100 < rate * 100)
        n = rows if drafting else 1
        control.observe_pass(n, PASS + ROW * (n - 1), (n - 1) if drafting else 0, STEP * (n - 1), 0.0)
    return on


def test_the_chain_goes_deep_where_the_draft_is_right_and_stops_where_it_is_not():
    deep, rate = speccontrol.best_depth(_measured(0.95), PASS, ROW, STEP)
    assert deep >= 12 and rate > 4 / PASS  # several tokens a pass for about the price of one
    short, _ = speccontrol.best_depth(_measured(0.6), PASS, ROW, STEP)
    assert 1 <= short < deep
    # where the pass is as cheap as a draft step, nothing pays
    assert speccontrol.best_depth(_measured(0.6), STEP, ROW, STEP)[0] == 0
    # a chain's yield: 1 + a + a^2 + ... (Leviathan et al.)
    assert speccontrol.chain_yield(_measured(0.9), 3) == pytest.approx(1 + 0.9 + 0.81 + 0.729, rel=0.02)


def test_the_rate_at_a_depth_seldom_reached_leans_on_the_pooled_rate():
    m = Measured([9.0, 0.0], [10.0, 0.5])  # depth 1 right 9 of 10; depth 2 seen half a time, never right
    assert m.rate(1) > 0.8
    assert 0.5 < m.rate(2) < m.rate(1)  # pulled toward the pooled rate, not 0
    assert m.rate(5) == pytest.approx(m.rate(3))  # past what was reached: the pooled rate


def test_a_losing_draft_is_turned_off_probed_and_turned_on_when_it_pays():
    control = Controller(PASS, ROW, STEP)
    on = _feed(control, 0.1, 3 * PROBE)  # a draft the target rejects: off, and probed every PROBE passes
    assert not all(on[PROBE:])
    off_runs = "".join("1" if x else "0" for x in on[2:]).split("1")
    assert max(len(r) for r in off_runs) == PROBE - 1  # never off longer than until the next probe
    assert control.n_off > PROBE
    on = _feed(control, 0.97, 4 * PROBE)  # the text turns predictable: the next probe finds it pays, and it stays
    assert all(on[-2 * PROBE:])
    assert control.plan()[0] >= 8


def test_always_keeps_the_draft_on_and_the_nodes_follow_the_measured_rates():
    control = Controller(PASS, ROW, STEP, always=True)
    assert all(_feed(control, 0.1, 2 * PROBE))
    control = Controller(PASS, ROW, STEP, measured=_measured(0.95))
    assert control.pays(0.9, 1) and control.pays(0.6, 10)
    assert not control.pays(0.01, 10)


def test_the_pass_line_follows_what_the_passes_measure():
    control = Controller(0.1, 0.001, STEP)  # the plan predicted a fast pass; the run's passes are slower
    for n in (1, 5, 9, 13, 1, 5, 9, 13) * 3:
        control.observe_pass(n, 0.4 + 0.03 * (n - 1), 0, 0.0, 0.0)
    pass_s, row_s = control.line()
    assert pass_s == pytest.approx(0.4, rel=0.1) and row_s == pytest.approx(0.03, rel=0.2)


def test_a_history_round_trips_and_scales_to_a_few_observations(tmp_path):
    path = history.path(tmp_path, "target", "draft")
    m = _measured(0.9, depth=4, weight=100.0)
    m.draft_step_s, m.row_s = 0.03, 0.02
    history.save(path, "code", m)
    history.save(path, "text", _measured(0.5, depth=2))
    notes = []
    stored = history.load(path, "code", notes)
    assert notes == [] and stored["draft_step_s"] == 0.03
    back = Measured.from_json(stored)
    assert back.rate(2) == pytest.approx(m.rate(2), abs=0.02)
    assert max(back.reached) <= speccontrol.HISTORY_WEIGHT  # a run's own passes soon outweigh it
    assert history.load(path, "text", notes) is not None and history.load(path, "chat", notes) is None


@pytest.mark.parametrize("content", ['{"pair": "target-draft", "kinds": {"code": {"accep', "not json",
                                     '{"pair": "other-pair", "kinds": {}}',
                                     '{"pair": "target-draft", "kinds": {"code": {"accepted": [5], "reached": [2], '
                                     '"side": [1, 2]}}}', "[1, 2]"])
def test_a_truncated_foreign_or_impossible_history_is_ignored_with_a_note(tmp_path, content):
    path = history.path(tmp_path, "target", "draft")
    path.write_text(content)
    notes = []
    assert history.load(path, "code", notes) is None
    assert len(notes) == 1 and "ignoring the speculation history" in notes[0]
    history.save(path, "code", _measured(0.9, depth=2))  # and the next run's replaces it
    assert json.loads(path.read_text())["pair"] == "target-draft"
    assert history.load(path, "code", []) is not None


def test_a_prompt_s_kind():
    assert history.kind("def f(x):\n    return x + 1\n") == "code"
    assert history.kind("Write a short letter to a friend about your holiday.") == "text"
    assert history.kind("") == "text"


def test_speculation_is_predicted_to_pay_only_where_the_target_waits_on_its_reads():
    """A chain's pass costs a row of compute per node: with every weight in memory (a pass is compute) the target
    alone is predicted faster at the prior's acceptance; where a pass is mostly reading, the draft's tokens pay."""
    compute, draft = 0.045, 0.012  # the 1.5B target's and the 0.5B draft's seconds a token from memory
    row = 0.7 * compute
    prior = Measured()
    assert speccontrol.predicted_tok_s(prior, compute, row, draft) == pytest.approx(1 / compute)
    assert speccontrol.predicted_tok_s(prior, 0.25, row, draft) > 1.5 / 0.25
    measured = _measured(0.95)
    measured.draft_step_s = 0.1  # a history's measured step outweighs the cost model's
    assert speccontrol.predicted_tok_s(measured, 0.25, row, draft) < speccontrol.predicted_tok_s(_measured(0.95), 0.25,
                                                                                                  row, draft)


def test_the_gain_a_run_made_is_kept_and_predicts_the_next_run():
    """A run's tokens a second over its one-token pass's rate (the gain) goes into the history, averaged with the
    one it started from, and a history with a gain predicts by it: the plan's pass divided by the gain."""
    control = Controller(PASS, ROW, STEP)
    for _ in range(12):  # passes of 9 rows giving 6 tokens, as the line PASS + ROW a row says
        control.observe_pass(9, PASS + 8 * ROW, 8, 8 * STEP, 0.0, tokens=6)
    m = control.measured()
    expected = 6 / (PASS + 8 * ROW + 8 * STEP) * PASS
    assert m.gain == pytest.approx(expected, rel=0.05)
    back = Measured.from_json(m.to_json())
    assert back.gain == pytest.approx(m.gain)
    assert speccontrol.predicted_tok_s(back, 0.3, ROW, STEP) == pytest.approx(m.gain / 0.3)
    again = Controller(PASS, ROW, STEP, measured=back)  # a run that made nothing of the draft halves the gain
    for _ in range(12):
        again.observe_pass(1, PASS, 0, 0.0, 0.0, tokens=1)
    assert again.measured().gain == pytest.approx(0.5 * (m.gain + 1.0), rel=0.05)
    with pytest.raises(ValueError):
        Measured.from_json({**m.to_json(), "gain": -1})


def test_a_run_with_no_predicted_pass_drafts_and_measures_first():
    """No plan's prediction (a mixture of experts, mmap): nothing to weigh the draft against until a pass is
    measured, so the first pass drafts a probe's chain, and the decisions follow the passes it measures."""
    control = Controller(None, ROW, STEP)
    assert control.draft_on() and control.pays(0.9, 1) and not control.pays(0.1, PROBE_DEPTH + 1)
    control.observe_pass(9, PASS + 8 * ROW, 8, 8 * STEP, 0.0, tokens=9)
    assert control.line()[0] > 0 and control.draft_on()


def _calibrated(weight: float = 20.0) -> Measured:
    """A pair whose top tokens are accepted 0.8 of the time at every depth, 0.98 where the draft gave the token
    0.9 or more and 0.02 where it gave it under 0.3 (an informative draft, as the real 0.5B is on code)."""
    m = _measured(0.8, depth=24)
    for b, rate in ((9, 0.98), (0, 0.02), (1, 0.02), (2, 0.02)):
        m.prob_accepted[b], m.prob_reached[b] = rate * weight, weight
    return m


def test_the_draft_s_own_confidence_is_trusted_as_far_as_it_was_measured():
    m = _calibrated()
    assert m.prob_rate(0.95) > 0.95 and m.prob_rate(0.25) < 0.1
    assert m.prob_rate(0.55) == pytest.approx(m.pooled())  # a tenth never seen: the pooled rate, not 0.55
    assert m.prob_rate(0.45, m.side_rate()) == pytest.approx(m.side_rate())  # or the rate of the token's rank
    control = Controller(PASS, ROW, STEP)
    control.observe_node(3, 1, True, 0.42)  # any rank counts, in its tenth
    control.observe_node(3, 0, False, 0.47)
    assert control.m.prob_reached[4] == pytest.approx(1.95) and control.m.prob_accepted[4] == pytest.approx(0.95)
    back = Measured.from_json(m.to_json())
    assert back.prob_rate(0.95) == pytest.approx(m.prob_rate(0.95), abs=0.02)
    assert max(back.prob_reached) <= speccontrol.HISTORY_WEIGHT
    old = {k: v for k, v in m.to_json().items() if not k.startswith("prob_")}  # a history from before: the prior
    assert Measured.from_json(old).prob_rate(0.95) == pytest.approx(Measured.from_json(old).pooled())
    with pytest.raises(ValueError):
        Measured.from_json({**m.to_json(), "prob_accepted": [1.0] * speccontrol.BINS, "prob_reached": [0.5] * 10})


class _Scripted(TreeGrower):
    """A grower whose draft gives its top token the probabilities scripted, one a step (no llama.cpp)."""

    def __init__(self, probs):
        super().__init__(None, None, Options(tree=False), [], None, 16, 32)
        self.probs = list(probs)

    def grow(self, c, branch, siblings):
        for n in c.tree.path(branch.leaf):  # the path decoded, as a draft step does before adding its token
            n.decoded = True
        node = c.tree.add(branch.leaf, 7, self.probs.pop(0))
        node.origins.append((None, 0))
        branch.leaf, branch.length = node, branch.length + 1
        return [node]


def _drafted(probs) -> list[float]:
    control = Controller(PASS, ROW, STEP, measured=_calibrated())
    c = _Call(None, None, None, 1000, 0.0, 0.3, tree=Tree(Node(1, None, 10, 1.0, 1.0)), control=control)
    c.pass_end = 1000
    _Scripted(probs).draft_measured(c, 48)
    return [n.prob for n in c.tree.path(c.tree.branches[0].leaf)[1:]]


def test_a_chain_goes_on_while_the_draft_is_sure_and_stops_at_the_first_token_it_is_not():
    """The depths' rates alone (0.8 each) would stop every chain at the same depth; by the draft's confidence a
    chain of sure tokens goes past it, and stops at the first unsure one, which is dropped: its step is spent, but
    its row in the pass would seldom repay (under 0.1 of the path's chance against a row's cost)."""
    by_depth, _ = speccontrol.best_depth(_calibrated(), PASS, ROW, STEP)
    sure = _drafted([0.99] * 60)
    assert len(sure) > by_depth + 4
    assert _drafted([0.99] * 6 + [0.2] + [0.99] * 60) == [0.99] * 6  # stopped at the unsure token, dropped
    assert _drafted([0.99] * 3 + [0.5] + [0.99] * 60)[:4] == [0.99] * 3 + [0.5]  # a middling one is kept
