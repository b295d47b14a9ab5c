"""What a request may not ask, checked in one place: each concern's own check (check_concern) and the combinations
refused across concerns or against the model (RULES, each with its reason; docs/options.md lists them). options.py
declares the options as data; this module, above the layers whose names and limits it checks against, says what of
them is refused.

`check(request)` runs every concern's check, then every rule on the request alone: the first that fails is a
one-line FlexoffloadError, before anything is loaded or measured. `check_model(request, model)` runs the rules that
read the model's header too (and the draft's, with -md), once prepare has it: still before a weight is read.

A guard below this layer that protects the API against the same input (the planners, the Speculator's settings)
raises the text its rule says, held as a constant there and named here: the text lives once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from flexoffload import FlexoffloadError
from flexoffload.gguf import catalog
from flexoffload.gguf.model import Model, load
from flexoffload.gguf.moefy import SOURCE_ARCH
from flexoffload.measure.sparsity import DENSE_ONLY
from flexoffload.defaults import EXPERT_LOOKAHEAD, EXPERT_READS, KV_TYPES, STRATEGIES
from flexoffload.native.devices import parse_endpoints
from flexoffload.options import CONCERN_CLASSES
from flexoffload.plan import levels, mixed
from flexoffload.plan.planners import WHOLE_LOOKAHEAD_REFUSED, WHOLE_SLOTS_REFUSED
from flexoffload.speculation.drafters import DRAFTERS, SPEC_TYPES
from flexoffload.speculation.settings import FLASH_ATTN_OFF, ROWS_REFUSED, RPC_FLASH_REFUSED
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
    if q.max_kld is not None and q.min_tok_s is not None:
        raise FlexoffloadError(mixed.BOTH_BOUNDS)
    if q.sparsity is not None and q.mode:
        return  # both: a rule across them says why not
    if q.sparsity is not None:
        if levels.parse(q.sparsity) != "auto" and q.max_kld is not None:
            raise FlexoffloadError("--max-kld goes with --sparsity auto (or --precision auto)")
        if q.min_tok_s is not None or q.original:
            raise FlexoffloadError("--min-tok-s and --original go with --precision auto")
    elif (q.max_kld is not None or q.min_tok_s is not None or q.original) and not q.mode:
        raise FlexoffloadError("--max-kld, --min-tok-s and --original go with --precision auto")


_CHECKS = {"generation": _check_generation, "budget": _check_budget, "draft": _check_draft,
           "placement": _check_placement, "precision": _check_precision}


def check_concern(config) -> None:
    """One concern's config (options.Generation, Budget, ...) checked on its own: a one-line FlexoffloadError."""
    _CHECKS[next(k for k, cls in CONCERN_CLASSES.items() if isinstance(config, cls))](config)


# --- the rules: combinations refused across concerns, or against the model's header, each with its reason ---------

@dataclass(frozen=True)
class Headers:
    """What a rule that needs the model reads: the target's header (the file run) and, with -md, the draft's."""
    target: Model
    draft: Model | None = None

    @property
    def kind(self) -> str:
        """The target's architecture as a refusal names it: "qwen3moe with experts"."""
        return self.target.arch + (" with experts" if self.target.n_expert else "")


@dataclass(frozen=True)
class Rule:
    """A refusal: `when(request)` says it applies (needs_model: `when(request, headers)`, a Headers), `message` is the
    one-line error (a model rule's may name the files: a str.format of r, the request, m, the Headers, and name and
    kind, the target's file name and architecture), `reason` why. `name`: how the tests name it."""
    name: str
    when: Callable[..., bool]
    message: str
    reason: str
    needs_model: bool = False

    def says(self, r, m: Headers | None = None) -> str:
        """The one-line error for this request (and model)."""
        if not self.needs_model:
            return self.message
        return self.message.format(r=r, m=m, name=m.target.path.name, kind=m.kind)


def _free_given(r) -> bool:
    free = spec_types(r.spec_type, r.draft)
    return bool(free) and free != ["auto"]


RULES: tuple[Rule, ...] = (
    Rule("prompt", lambda r: not r.prompt, "no prompt: give one with -p TEXT or -f FILE",
         "the first token is decoded from the prompt's last logits"),
    Rule("precision-alone",
         lambda r: bool(r.precision) and (not r.mem or r.plan_dir or r.rpc or (r.strategy or "stream") != "stream"
                                          or r.policy != "balanced" or r.window is not None),
         "--precision auto plans precision with residency under --mem, by the balanced policy: not with --plan, "
         "--rpc, --policy, --window or another --strategy", "the requantized file and its plan are made together "
         "under this machine's budget, the walk predicting each point by the balanced plan; a saved plan or a "
         "placement across devices was made for another file"),
    Rule("sparsity-alone",
         lambda r: r.sparsity is not None and bool(r.precision or r.draft or r.rpc or r.plan_dir or r.chat),
         "--sparsity: not with --precision, -md, --rpc, --plan or -cnv",
         "a level is its own grouped file run through the expert-selective path: each of a tree's tokens reads its "
         "own groups (measured not to pay on the 1.5B, docs/neurons.md); with --rpc, --plan or -cnv it is not built"),
    Rule("spec-rpc-flash", lambda r: (bool(r.draft) or _free_given(r)) and r.flash_attn == "off" and bool(r.rpc),
         RPC_FLASH_REFUSED, FLASH_ATTN_OFF),
    Rule("spec-rows", lambda r: (bool(r.draft) or _free_given(r)) and (r.n_ubatch == 1 or r.n_batch < 2),
         ROWS_REFUSED, "a tree is verified in one forward pass"),
    Rule("forced-alone", lambda r: bool(r.forced) and (bool(r.draft) or _free_given(r) or r.chat),
         "a forced text decodes token by token: not with -md, --spec-type or -cnv",
         "teacher forcing measures the target's decode as a text routes it; a tree or a conversation would choose "
         "other tokens"),
    Rule("tune-alone",
         lambda r: r.tune is not None and (not r.mem or r.policy != "balanced" or r.window is not None
                                           or bool(r.precision or r.rpc or r.plan_dir or r.draft)
                                           or (r.strategy or "stream") != "stream"),
         "--tune measures plans under --mem: it chooses the policy and window; not with --precision, --rpc, --plan, "
         "-md or another --strategy",
         "the candidates are the balanced plans by window and every baseline policy, each run cold under the "
         "enforced budget by the target alone; a precision plan, a placement, a saved plan or a draft's tree is "
         "another run"),
    Rule("rpc-draft", lambda r: bool(r.rpc and r.draft),
         "--rpc and -md: speculation with a draft model runs on this machine only",
         "not built: the draft's placement beside the target's on the servers (free drafters do run with --rpc, "
         "their trees kept under the servers' tiled kernels' 8 rows)"),
    Rule("whole-slots", lambda r: r.expert_reads == "whole" and r.expert_slots is not None, WHOLE_SLOTS_REFUSED,
         "an expert tensor read whole is streamed by the window as a dense tensor: there is no expert to cache"),
    Rule("whole-lookahead", lambda r: r.expert_reads == "whole" and r.expert_lookahead == "on",
         WHOLE_LOOKAHEAD_REFUSED, "lookahead reads the next layer's predicted experts one by one into its slots; "
         "read whole, every expert is read anyway"),
    # the rules that read the model's header (cheap: gguf.model.load reads no weight)
    Rule("draft-vocabulary", lambda r, m: m.draft is not None and m.draft.n_vocab != m.target.n_vocab,
         "the draft {m.draft.path.name} has another vocabulary ({m.draft.n_vocab} tokens, the target "
         "{m.target.n_vocab}): a draft must share the target's tokens",
         "a tree's tokens are the draft's ids, verified as the target's", needs_model=True),
    Rule("sparsity-dense", lambda r, m: r.sparsity is not None and (m.target.arch != SOURCE_ARCH
                                                                    or bool(m.target.n_expert)),
         DENSE_ONLY,
         "predicted neurons are groups of a dense FFN's neurons (gguf/moefy.py re-lays out a " + SOURCE_ARCH +
         " SwiGLU FFN); a mixture of experts has no dense FFN to group", needs_model=True),
)
BY_NAME = {rule.name: rule for rule in RULES}



def check(r) -> None:
    """Each concern's own check, then the checks across concerns: a one-line FlexoffloadError for the first that
    fails."""
    for concern in r.concerns().values():
        check_concern(concern)
    for rule in RULES:
        if not rule.needs_model and rule.when(r):
            raise FlexoffloadError(rule.says(r))


def check_model(r, model: Model) -> None:
    """The rules that read the model's header (and the draft's, with -md: its header read here): a one-line
    FlexoffloadError for the first that fails. prepare calls it once it has the file run."""
    m = Headers(model, load(catalog.resolve(r.draft)) if r.draft else None)
    for rule in RULES:
        if rule.needs_model and rule.when(r, m):
            raise FlexoffloadError(rule.says(r, m))


def refusals_table() -> str:
    """RULES as a markdown table (docs/options.md); a model rule's message with what it names in <>."""
    rows = ["| refused | reads | why |", "| --- | --- | --- |"]
    for rule in RULES:
        message = re.sub(r"\{(?:[rm]\.)?([\w.]+)\}", lambda f: "<" + f.group(1).replace(".path", "") + ">",
                         rule.message)
        rows.append(f"| {message} | {'the model too' if rule.needs_model else 'the request'} | {rule.reason} |")
    return "\n".join(rows)
