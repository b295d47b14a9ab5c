"""What a request may not ask, checked in one place: each concern's own check (check_concern) and the combinations
refused across concerns (RULES, each with its reason; docs/options.md lists them). options.py declares the options
as data; this module, above the layers whose names and limits it checks against, says what of them is refused.

`check(request)` runs every concern's check, then every rule: the first that fails is a one-line FlexoffloadError,
before anything is loaded or measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from flexoffload import FlexoffloadError
from flexoffload.defaults import EXPERT_LOOKAHEAD, EXPERT_READS, KV_TYPES, STRATEGIES
from flexoffload.native.devices import parse_endpoints
from flexoffload.options import CONCERN_CLASSES
from flexoffload.plan import levels, mixed
from flexoffload.speculation.drafters import DRAFTERS, SPEC_TYPES
from flexoffload.speculation.settings import FLASH_ATTN_OFF
from flexoffload.speculation.tree import MAX_NODES


# --- each concern's own check --------------------------------------------------------------------------------------

def _check_generation(g) -> None:
    if g.n_ctx < 16 or g.n_batch < 1 or g.n_threads < 1:
        raise FlexoffloadError("-c must be at least 16, -b, -t and --io-threads at least 1, --window at least 0")
    if g.n_ubatch < 0 or g.n_ubatch > g.n_batch or g.flash_attn not in ("on", "off", "auto"):
        raise FlexoffloadError("-ub must be between 1 and -b, -fa one of on, off, auto")
    if g.cache_type_k not in KV_TYPES or g.cache_type_v not in KV_TYPES:
        raise FlexoffloadError(f"-ctk and -ctv must be one of {', '.join(KV_TYPES)}")
    if g.cache_type_v not in ("f16", "f32", "bf16") and g.flash_attn == "off":
        raise FlexoffloadError(f"a {g.cache_type_v} V cache needs flash attention: -fa on or auto")


def _check_budget(b) -> None:
    if b.strategy not in (None,) + STRATEGIES:
        raise FlexoffloadError(f"unknown strategy {b.strategy!r}: one of {', '.join(STRATEGIES)}")
    if (b.io_threads is not None and b.io_threads < 1) or (b.window is not None and b.window < 0):
        raise FlexoffloadError("-c must be at least 16, -b, -t and --io-threads at least 1, --window at least 0")
    if b.strategy == "sync" and b.window is not None:
        raise FlexoffloadError("--window does not apply to sync: it reads each tensor when compute needs it")
    if b.strategy == "mmap" and (b.window is not None or b.io_threads is not None or b.plan_dir):
        raise FlexoffloadError("--window, --io-threads and --plan stream weights: not with --strategy mmap")
    if b.tune is not None and (b.tune < 1 or b.tune_rounds < 1):
        raise FlexoffloadError("--tune takes N >= 1 and --tune-rounds >= 1")
    if b.expert_reads not in EXPERT_READS:
        raise FlexoffloadError(f"unknown expert reads {b.expert_reads!r}: one of {', '.join(EXPERT_READS)}")
    if b.expert_lookahead not in EXPERT_LOOKAHEAD:
        raise FlexoffloadError(f"unknown expert lookahead {b.expert_lookahead!r}: one of "
                               f"{', '.join(EXPERT_LOOKAHEAD)}")


def spec_types(value: str | None, draft: str | None) -> list[str]:
    """--spec-type's free drafters (speculation/drafters.py), ["auto"] while undecided, [] for none; with -md the draft
    model is in the tree whatever the list says."""
    names = [n.strip() for n in (value or "none").split(",") if n.strip()]
    for n in names:
        if n == "layers":  # measured before building: scripts/layers_study, results/layers_draft_qwen1.5b.csv
            raise FlexoffloadError("--spec-type layers is not built: a draft through the layers a plan keeps "
                                   "resident gave the target's greedy token 0-2 % of the time on the 1.5B at "
                                   "0.4x-0.8x (docs/speculation.md)")
        if n not in SPEC_TYPES + ("none",):
            raise FlexoffloadError(f"unknown --spec-type {n!r}: a list of {', '.join(SPEC_TYPES)}, or none")
    if ("auto" in names or "none" in names) and len(names) > 1:
        raise FlexoffloadError("--spec-type auto and none stand alone, not in a list")
    if "model" in names and not draft:
        raise FlexoffloadError("--spec-type model is the draft model: give it with -md")
    return ["auto"] if names == ["auto"] else [n for n in names if n in DRAFTERS]


def _check_draft(d) -> None:
    if d.spec not in ("tree", "chain"):
        raise FlexoffloadError(f"unknown speculation shape {d.spec!r}: tree or chain")
    spec_types(d.spec_type, d.model)
    if d.max is not None and (d.max < 1 or (d.model and not 2 <= d.max <= MAX_NODES)):
        raise FlexoffloadError(f"--draft-max must be between 2 and {MAX_NODES} with -md, at least 1 without it")
    if not 0 < d.p_split <= 1:
        raise FlexoffloadError("--draft-p-split must be in (0, 1]")


def _check_placement(p) -> None:
    if p.rpc:
        parse_endpoints(p.rpc)
    if p.n_gpu_layers < 0:
        raise FlexoffloadError("-ngl must be at least 0")
    if p.n_gpu_layers and not p.rpc:
        raise FlexoffloadError("-ngl offloads layers to RPC servers here (this build has no GPU): add --rpc")


def _check_precision(q) -> None:
    if q.mode not in (None, "auto"):
        raise FlexoffloadError(f"--precision takes auto (the file's own types: leave it out), not {q.mode}")
    if q.sparsity is not None and q.mode:
        return  # both: a rule across them says why not
    if q.sparsity is not None:
        if levels.parse(q.sparsity) != "auto" and q.max_kld is not None:
            raise FlexoffloadError("--max-kld goes with --sparsity auto (or --precision auto)")
        if q.min_tok_s is not None or q.original:
            raise FlexoffloadError("--min-tok-s and --original go with --precision auto")
    else:
        mixed.check_options(q.mode, q.max_kld, q.min_tok_s, q.original)


_CHECKS = {"generation": _check_generation, "budget": _check_budget, "draft": _check_draft,
           "placement": _check_placement, "precision": _check_precision}


def check_concern(config) -> None:
    """One concern's config (options.Generation, Budget, ...) checked on its own: a one-line FlexoffloadError."""
    _CHECKS[next(k for k, cls in CONCERN_CLASSES.items() if isinstance(config, cls))](config)


# --- checks across concerns: the combinations that remain refused, each with its reason ----------------------------

@dataclass(frozen=True)
class Rule:
    """A combination refused: `when(request)` says it applies, `message` is the one-line error, `reason` why."""
    when: Callable
    message: str
    reason: str


def _free_given(r) -> bool:
    free = spec_types(r.spec_type, r.draft)
    return bool(free) and free != ["auto"]


RULES: tuple[Rule, ...] = (
    Rule(lambda r: bool(r.precision) and (not r.mem or r.plan_dir or r.rpc or (r.strategy or "stream") != "stream"
                                          or r.policy != "balanced" or r.window is not None),
         "--precision auto plans precision with residency under --mem, by the balanced policy: not with --plan, "
         "--rpc, --policy, --window or another --strategy", "the requantized file and its plan are made together "
         "under this machine's budget, the walk predicting each point by the balanced plan; a saved plan or a "
         "placement across devices was made for another file"),
    Rule(lambda r: r.sparsity is not None and bool(r.precision or r.draft or r.rpc or r.plan_dir or r.chat),
         "--sparsity: not with --precision, -md, --rpc, --plan or -cnv",
         "a level is its own grouped file run through the expert-selective path: each of a tree's tokens reads its "
         "own groups (measured not to pay on the 1.5B, docs/neurons.md); with --rpc, --plan or -cnv it is not built"),
    Rule(lambda r: (bool(r.draft) or _free_given(r)) and r.flash_attn == "off" and bool(r.rpc),
         "speculation with --rpc verifies its trees with flash attention: not with -fa off", FLASH_ATTN_OFF),
    Rule(lambda r: (bool(r.draft) or _free_given(r)) and (r.n_ubatch == 1 or r.n_batch < 2),
         "speculation (-md, --spec-type) verifies trees of 2 tokens or more a pass: -b and -ub at least 2",
         "a tree is verified in one forward pass"),
    Rule(lambda r: bool(r.forced) and (bool(r.draft) or _free_given(r) or r.chat),
         "a forced text decodes token by token: not with -md, --spec-type or -cnv",
         "teacher forcing measures the target's decode as a text routes it; a tree or a conversation would choose "
         "other tokens"),
    Rule(lambda r: r.tune is not None and (not r.mem or r.policy != "balanced" or r.window is not None
                                           or bool(r.precision or r.rpc or r.plan_dir or r.draft)
                                           or (r.strategy or "stream") != "stream"),
         "--tune measures plans under --mem: it chooses the policy and window; not with --precision, --rpc, --plan, "
         "-md or another --strategy",
         "the candidates are the balanced plans by window and every baseline policy, each run cold under the "
         "enforced budget by the target alone; a precision plan, a placement, a saved plan or a draft's tree is "
         "another run"),
    Rule(lambda r: bool(r.rpc and r.draft), "--rpc and -md: speculation with a draft model runs on this machine only",
         "not built: the draft's placement beside the target's on the servers (free drafters do run with --rpc, "
         "their trees kept under the servers' tiled kernels' 8 rows)"),
)


def check(r) -> None:
    """Each concern's own check, then the checks across concerns: a one-line FlexoffloadError for the first that
    fails."""
    for concern in r.concerns().values():
        check_concern(concern)
    if not r.prompt:
        raise FlexoffloadError("no prompt: give one with -p TEXT or -f FILE")
    for rule in RULES:
        if rule.when(r):
            raise FlexoffloadError(rule.message)


def refusals_table() -> str:
    """RULES as a markdown table (docs/options.md)."""
    rows = ["| refused | why |", "| --- | --- |"]
    rows += [f"| {rule.message} | {rule.reason} |" for rule in RULES]
    return "\n".join(rows)
