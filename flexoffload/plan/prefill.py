"""Step-aware prefill: the ubatch a long prompt is computed in, chosen under the budget (HyperGen, issue 16).

A prefill of L tokens in ubatches of u makes ceil(L/u) forward passes, and every pass reads every streamed tensor
once; a larger u pays the disk fewer times and computes more efficiently (a matrix multiplication over more rows
reuses each weight it reads), but its compute buffer (stepmem) takes memory from the resident weights for the whole
run, so decode streams more. So the choice is the u minimizing the run's predicted time: time to first token plus
the tokens to generate at the plan's decode speed.

When decode starts, the context's ubatch becomes DECODE_UBATCH (patch 0015 sizes the compute buffers again, and
their memory comes back) and the streamed tensors that memory holds become resident, each read once (0013, 0014):
`after_prefill` chooses them (`choose_ubatch` picks the ubatch, from llama.cpp's buffers as measure/dryrun.py measures
them), so decode runs at a plan for its own buffers, not the prefill's.

The time to first token is predicted per pass as its compute (measured: measure/ubatches.py's `rates`, a ubatch's
pass with every weight in memory, by u) plus its reads of the streamed tensors (`pass_seconds`: measured, the two
do not overlap in a prefill). Attention's growth with the cells already filled, and its cost per KV type, are not
modelled: the prediction is close at 2048 tokens, 2.3x short at 8192 and 12x at 16384 with a q8_0 cache
(results/hypergen_qwen1.5b_ttft.csv). That cost does not depend on the ubatch, so the choice stands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexoffload import FlexoffloadError
from flexoffload.gguf.model import Model
from flexoffload.memory.stepmem import UBATCHES
from flexoffload.plan.costmodel import Profile
from flexoffload.plan.planners import make_plan
from flexoffload.plan.plans import Plan, streamed_bytes
from flexoffload.plan.replay import unit_bytes, unit_reads

DECODE_UBATCH = 1  # tokens a decode pass computes: one (this engine decodes a token at a time after the prompt)


def after_prefill(model: Model, plan: Plan, room: int, profile: Profile) -> tuple[tuple[str, ...], float]:
    """The streamed tensors to make resident when decode starts, and decode's predicted tok/s with them.

    room is the memory the compute buffers give back going from the prefill's ubatch to DECODE_UBATCH (llama.cpp's
    dry run of both: measure.stepmem.room; the CPU work buffer and the logits are kept, so not counted). It goes
    first to the layer that streams the most, the largest of its tensors that fits, and so on (a balanced pipeline:
    decode waits on its slowest layer). A tensor only looked up by rows (token_embd) costs decode a few rows: it
    stays streamed. The read pool keeps its size (it never shrinks), so the window's memory is unchanged."""
    from flexoffload.plan.costmodel import looked_up_only, predict

    if room <= 0 or not plan.streamed:
        return (), plan.predicted_tok_s
    by_name = {t.name: t for t in model.tensors}
    left = [by_name[n] for n in plan.streamed if not looked_up_only(model, by_name[n])]
    load = {}  # streamed bytes left per layer
    for t in left:
        load[t.layer] = load.get(t.layer, 0) + t.n_bytes
    chosen = []
    while True:
        fits = [t for t in left if t.n_bytes <= room]
        if not fits:
            break
        pick = max(fits, key=lambda t: (load[t.layer], t.n_bytes))
        chosen.append(pick.name)
        room -= pick.n_bytes
        load[pick.layer] -= pick.n_bytes
        left.remove(pick)
    if not chosen:
        return (), plan.predicted_tok_s
    tok_s = predict(model, set(plan.resident) | set(chosen), profile, plan.window, plan.io_threads).tok_s
    return tuple(chosen), tok_s


def pass_seconds(model: Model, plan: Plan, n_tokens: int, profile: Profile, rate: dict[int, float]) -> float:
    """A prefill pass of n_tokens under the plan: its compute (measured with every weight in memory) plus its reads
    of the streamed tensors and of the routed experts its tokens miss (expert_read_seconds). Not overlapped:
    measured at 0.3x and 0.5x on the 1.5B, prefill passes took about their compute plus their reads whatever the
    window (results/prefill_chosen_qwen1.5b.csv), where decode's reads hide behind its compute; why is still open.
    A pipeline simulation with the window predicted 1.5-2x too fast."""
    u = min((x for x in rate if x >= n_tokens), default=max(rate))
    compute = rate[u] * n_tokens / u
    routed = plan.experts.bytes_per_token if plan.experts is not None else 0  # a decoded token's misses: not a pass's
    return (compute + (streamed_bytes(plan, model) - routed) / profile.disk_bw
            + expert_read_seconds(model, plan, n_tokens, profile))


def expert_read_seconds(model: Model, plan: Plan, n_tokens: int, profile: Profile) -> float:
    """A pass's reads of routed experts: each layer reads the experts its n_tokens route to that its cache lacks,
    one burst after its router (profile.expert_read_seconds). Routing taken as uniform (a token misses an expert
    with probability 1 - k/n), so a ubatch of 256 tokens names all 128 experts of Qwen3-30B-A3B's layers (text
    routing named about 96 % of them, docs/moe.md): every pass reads them again, which is what a larger ubatch
    saves. The cache holds slots/n of them."""
    e = plan.experts
    if e is None or e.whole or not model.n_expert:
        return 0.0  # expert tensors streamed whole are streamed tensors: streamed_bytes counts them
    k, n = model.n_expert_used, model.n_expert
    missed = n * (1 - (1 - k / n) ** n_tokens) * (1 - min(e.slots, n) / n)
    return sum(profile.expert_read_seconds(int(missed * b), math.ceil(missed * r), plan.io_threads)
               for b, r in zip(unit_bytes(model), unit_reads(model)) if r)


def ttft(model: Model, plan: Plan, n_prompt: int, n_ubatch: int, profile: Profile, rate: dict[int, float]) -> float:
    """Predicted seconds to the first token: the passes of full ubatches, then the rest."""
    full, rest = divmod(n_prompt, n_ubatch)
    seconds = full * pass_seconds(model, plan, n_ubatch, profile, rate)
    if rest:
        seconds += pass_seconds(model, plan, rest, profile, rate)
    return seconds


@dataclass(frozen=True)
class Ubatch:
    """A ubatch a prompt may be computed in, as llama.cpp's buffers make it (measure/dryrun.py): the costs beside
    the weights a plan at it has (make_plan's kv_cache, compute, overhead, code) and the memory its buffers give back
    when decode starts."""
    n_ubatch: int
    costs: dict
    room: int


def ubatches_for(n_prompt: int) -> list[int]:
    """The ubatches worth trying for a prompt: UBATCHES up to the least that holds it in one pass (a larger one only
    takes memory)."""
    ordered = sorted(UBATCHES)
    held = next((i for i, u in enumerate(ordered) if u >= n_prompt), len(ordered) - 1)
    return ordered[:held + 1]


def choose_ubatch(model: Model, budget: int, n_prompt: int, n_predict: int, policy: str, profile: Profile,
                  io_threads: int, rate: dict[int, float], candidates: list[Ubatch]) -> tuple[int, Plan, float] | None:
    """The ubatch whose plan the cost model predicts the run fastest with (time to first token, then n_predict tokens
    at decode's speed), that plan, and its predicted time to first token; None where no candidate's buffers fit
    beside the smallest plan."""
    best = None
    for c in candidates:
        try:
            plan = make_plan(model, budget, policy, profile, io_threads=io_threads, **c.costs)
        except FlexoffloadError:
            continue  # its compute buffer does not fit beside the smallest plan
        first = ttft(model, plan, n_prompt, c.n_ubatch, profile, rate)
        _, decode_tok_s = after_prefill(model, plan, c.room, profile)
        total = first + max(n_predict, 1) / decode_tok_s
        if best is None or total < best[0]:
            best = (total, c.n_ubatch, plan, first)
    return None if best is None else best[1:]
