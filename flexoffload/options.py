"""Every option once: its flags, type, default, help, the commands that take it and the concern it belongs to (as
llama.cpp's common/arg.cpp declares each flag once with the tools that take it).

From the one table come:
- each command's click options (cli/common.py's `click_options("run")`), in the table's order;
- `Request`, the flat form a run is asked in (the command line's, vLLM's EngineArgs), one field per option;
- the per-concern configs `Generation`, `Budget`, `Draft`, `Placement`, `Precision` (llama.cpp's nested
  common_params), each with its own `check()`; `Request.concerns()` splits a request into them and `request()`
  flattens them back;
- `check(request)`: each concern's own check, then the checks across concerns, in one place (RULES: the
  combinations that remain refused, each with its reason; docs/options.md lists them).

A request stays as the user gave it: what `api.prepare` decides travels as its own object (api.Prepared).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, make_dataclass
from typing import Callable

from flexoffload import FlexoffloadError
from flexoffload.defaults import EXPERT_LOOKAHEAD, EXPERT_READS, STRATEGIES
from flexoffload.gguf.catalog import DEFAULT_MODEL
from flexoffload.native.devices import parse_endpoints
from flexoffload.plan import levels, mixed
from flexoffload.speculation.drafters import DRAFTERS, SPEC_TYPES
from flexoffload.runtime.engine import KV_TYPES
from flexoffload.speculation.settings import FLASH_ATTN_OFF
from flexoffload.speculation.tree import MAX_NODES

PLACEMENTS = ("auto", "oato", "layers", "split")  # placers.solve's policies
COMMANDS = ("run", "plan", "serve", "bench", "profile")
STREAMING = ("run", "plan", "serve")  # the commands that plan a run under a budget


@dataclass(frozen=True)
class Option:
    """One option: `name` is its Request field, `key` its name in its concern's config (default: name)."""
    name: str
    flags: tuple[str, ...]  # click's declarations ("-c", "--ctx-size"); () for an API-only field
    default: object = None
    help: str = ""
    commands: tuple[str, ...] = ("run",)
    concern: str = "generation"  # generation, budget, draft, placement, precision; "" for the request's own
    type: type | None = None  # the value's type where the default does not say it (None: the default's)
    choices: tuple[str, ...] | None = None
    minimum: int | None = None  # a whole number at least this
    path: str | None = None  # "dir": a folder path (need not exist); "file": an existing file
    is_flag: bool = False
    flag_value: object = None  # a negative flag (--no-pacer) sets False
    metavar: str | None = None
    key: str | None = None
    command_defaults: dict = field(default_factory=dict)  # a command whose default differs (serve's -c), said here
    command_help: dict = field(default_factory=dict)  # and one whose help says more (plan's -n)
    required_by: tuple[str, ...] = ()
    envvar: str | None = None

    @property
    def field_name(self) -> str:
        return self.key or self.name

    def default_for(self, command: str):
        return self.command_defaults.get(command, self.default)

    def help_for(self, command: str) -> str:
        return self.command_help.get(command, self.help)


THREADS = os.cpu_count() or 1
SPEC_HELP = ("free drafters for a speculation tree, a comma list: ngram-simple, ngram-map-k, recycle (no memory but "
             "a table), model (-md, in the tree whenever given); none; auto: with -md model,ngram-simple, without it "
             "ngram-simple,recycle where the plan streams and its pass is disk-bound (docs/speculation.md)")

OPTIONS: tuple[Option, ...] = (
    # the request's own
    Option("model", ("-m", "--model"), None, f"GGUF path or catalog name [default: {DEFAULT_MODEL}]",
           COMMANDS, "", metavar="MODEL"),
    Option("prompt", (), "", "the prompt text (run reads -p or -f)", (), ""),
    Option("chat", ("-cnv", "--conversation"), False,
           "chat at the terminal in the model's chat template, the history kept (-p, -f or -sys: the system "
           "message; -n: each reply's limit, to the end of its turn by default)", ("run",), "", is_flag=True),
    # generation: what to generate, and llama.cpp's context for it
    Option("n_predict", ("-n", "--n-predict"), 128, "tokens to generate (-1: until end of text)",
           ("run", "plan", "bench"), command_defaults={"bench": 32, "plan": 0},
           command_help={"plan": "with --max-prompt: tokens to generate after it"}),
    Option("n_ctx", ("-c", "--ctx-size"), 2048, "context size in tokens", COMMANDS[:4],
           command_defaults={"serve": 4096},
           command_help={"serve": "context cells, shared by the sequences: each has -c / -np"}),
    Option("n_batch", ("-b", "--batch-size"), 512, "prompt tokens per llama_decode call", STREAMING),
    Option("n_ubatch", ("-ub", "--ubatch-size"), 0,
           "prompt tokens per forward pass [default: -b; under --mem, chosen for a prompt over 256 tokens]",
           STREAMING, minimum=0),
    Option("flash_attn", ("-fa", "--flash-attn"), "auto", "llama.cpp's attention path", STREAMING,
           choices=("on", "off", "auto")),
    Option("cache_type_k", ("-ctk", "--cache-type-k"), "f16", "the KV cache's K type", STREAMING,
           choices=tuple(KV_TYPES)),
    Option("cache_type_v", ("-ctv", "--cache-type-v"), "f16", "the KV cache's V type (quantized: with flash "
           "attention)", STREAMING, choices=tuple(KV_TYPES)),
    Option("n_threads", ("-t", "--threads"), THREADS, "compute threads", COMMANDS),
    Option("forced", (), "", "text decoded after the prompt in place of the sampled tokens, token by token (teacher "
           "forcing): a benchmark's decode that routes as real text does on a synthetic model whose own output is "
           "noise (no speculation)", ()),
    Option("temp", ("--temp",), 0.8, "temperature; 0 is greedy", ("run",)),
    Option("seed", ("--seed",), -1, "sampling seed (-1: random)", ("run",)),
    Option("verbose", ("-v", "--verbose"), False, "show llama.cpp's log", ("run", "serve"), is_flag=True),
    # budget: the memory budget and how weights reach memory
    Option("mem", ("--mem",), None, "memory budget for the whole process: 400M, 1.5G, or 0.4x of the model's size "
           "(per device with --rpc: cpu=SIZE,rpc0=SIZE,...)", STREAMING, "budget", required_by=("plan",)),
    Option("strategy", ("--strategy",), None, "stream (the default with --mem or --plan), mmap (upstream; the "
           "default otherwise), prefetch, sync", STREAMING, "budget"),
    Option("policy", ("--policy",), "balanced", "what stays resident under --mem: balanced, flexinfer, attn-first, "
           "ffn-first, layer", STREAMING, "budget"),
    Option("plan_dir", ("--plan",), None, "stream by a saved plan (flexoffload plan -o DIR)", ("run", "serve"),
           "budget", path="dir"),
    Option("window", ("--window",), None, "prefetch window in layers [default: the plan's]", STREAMING, "budget",
           minimum=0),
    Option("io_threads", ("--io-threads",), None, "threads reading streamed weights [default: the plan's, 4]",
           STREAMING, "budget", minimum=1),
    Option("expert_slots", ("--expert-slots",), None, "a mixture of experts: experts each layer keeps cached "
           "[default: the plan's]", STREAMING, "budget", minimum=0),
    Option("expert_reads", ("--expert-reads",), "auto", "a mixture of experts: read the routed experts once the "
           "router has chosen, or the expert tensors whole ahead of compute (faster where a token uses a large share "
           "of them); auto: the plan's", STREAMING, "budget", choices=tuple(EXPERT_READS)),
    Option("expert_lookahead", ("--expert-lookahead",), "auto", "a mixture of experts: while a layer computes, read "
           "the next layer's experts its router is predicted to choose (this layer's router input through the next "
           "layer's router); auto: the plan's (on where a token's experts fit in the slots)", STREAMING, "budget",
           choices=tuple(EXPERT_LOOKAHEAD)),
    Option("tuned", ("--tuned/--untuned",), True, "stream by the plan `plan --tune` made for this model, budget and "
           "-c/-b, where there is one", ("run", "serve"), "budget"),
    Option("move_back", (), True, "after the prompt, the compute buffers' memory goes to weights (False: an "
           "ablation)", (), "budget"),
    # draft: speculation, by a resident draft model and free drafters
    Option("draft", ("-md", "--model-draft"), None, "a draft model kept resident: token-tree speculation (same "
           "vocabulary as the target)", ("run", "plan", "serve"), "draft", metavar="MODEL", key="model"),
    Option("spec_type", ("--spec-type",), "auto", SPEC_HELP, ("run", "plan", "serve"), "draft", metavar="LIST"),
    Option("draft_max", ("--draft-max",), None, "node budget of a speculation tree [default: from the measured "
           "target pass and draft token]", ("run", "plan", "serve"), "draft", type=int, key="max"),
    Option("draft_p_split", ("--draft-p-split",), 0.3, "a draft candidate this likely opens a branch",
           ("run",), "draft", key="p_split"),
    Option("spec", ("--spec",), "tree", "speculation shape: a token tree, or a linear chain", ("run",), "draft",
           choices=("tree", "chain")),
    Option("pacer", ("--no-pacer",), True, "grow branches in turn, not by confidence (ablation)", ("run",),
           "draft", is_flag=True, flag_value=False),
    Option("adaptive", ("--no-adaptive",), True, "verify only at the node budget, not on low confidence "
           "(ablation)", ("run",), "draft", is_flag=True, flag_value=False),
    Option("adaptive_split", ("--no-adaptive-split",), True, "keep --draft-p-split as given, not moved by which "
           "branches the target accepts (ablation)", ("run",), "draft", is_flag=True, flag_value=False),
    Option("tiled_verify", ("--tiled-verify",), False, "verify with the tiled kernels from 8 tree nodes, as "
           "llama.cpp does: cheaper nodes, but greedy output may differ from the target alone's at near ties "
           "(ablation)", ("run",), "draft", is_flag=True),
    Option("pipeline", ("--pipeline/--no-pipeline",), False, "draft on while the target verifies, under "
           "SCHED_IDLE (within noise on 2 cores: off by default)", ("run",), "draft"),
    Option("draft_always", ("--draft-always",), False, "load the draft where a stored history predicts the target "
           "alone faster at --mem, and never turn it off while running [default: the run decides by measuring]",
           ("run", "plan"), "draft", is_flag=True, key="always"),
    Option("draft_quant", ("--draft-quant",), "auto", "the draft's weights: at its own types, all Q4_0 (a copy "
           "made once and cached), or auto: its own types, the copy where those do not fit beside the target or "
           "where the copy's measured acceptance predicts it faster", ("run", "plan"), "draft",
           choices=("auto", "own", "q4_0"), key="quant"),
    Option("spec_control", ("--spec-control",), "measured", "what sizes a draft model's trees: the acceptance and "
           "costs the run measures (depth by acceptance, the draft off where it loses), or LLMCad's confidence "
           "rules (the reproduction's)", ("run",), "draft", choices=("measured", "llmcad"), key="control"),
    Option("history", ("--no-history",), True, "neither read nor write the stored acceptance history of this "
           "model pair (the run starts from the prior)", ("run", "plan"), "draft", is_flag=True, flag_value=False),
    # placement: RPC servers
    Option("rpc", ("--rpc",), None, "RPC servers (ggml-rpc-server) to place weights on: by --plan, by -ngl, or "
           "placed now with --mem (cpu=SIZE,rpc0=SIZE,...)", STREAMING, "placement",
           metavar="HOST:PORT,..."),
    Option("n_gpu_layers", ("-ngl", "--n-gpu-layers"), 0, "with --rpc: the last layers to offload to the servers, "
           "each with its KV cache (llama.cpp's -ngl)", STREAMING, "placement", minimum=0),
    Option("placement", ("--placement",), "auto", "with --rpc and --mem: how weights are placed across the "
           "devices", STREAMING, "placement", choices=tuple(PLACEMENTS), key="policy"),
    # precision: lowered types, predicted neurons
    Option("precision", ("--precision",), None, "with --mem: lower some tensors' types where it costs the least "
           "quality per byte saved (profile --precision measures it) [default: the file's own types]",
           ("run", "plan"), "precision", choices=("auto",), key="mode"),
    Option("max_kld", ("--max-kld",), None, "with --precision auto: the fastest plan whose summed KL divergence is "
           "at most this; with --sparsity auto: the fewest neuron groups within it [0.05]", ("run", "plan"),
           "precision", type=float),
    Option("min_tok_s", ("--min-tok-s",), None, "with --precision auto: instead, the least harm that reaches this "
           "predicted tok/s", ("run", "plan"), "precision", type=float),
    Option("original", ("--original",), None, "with --precision auto: the model's original F16/BF16 weights, "
           "quantized from instead of requantizing the file (a second rounding loses more)", ("run", "plan"),
           "precision", path="file", metavar="GGUF"),
    Option("sparsity", ("--sparsity",), None, "predicted neurons: each FFN's hot neurons and the K of its groups a "
           "predictor picks (auto: the fewest within --max-kld, where that is predicted faster than the dense "
           "model); profile --neurons measures them [default: dense]", ("run",), "precision", metavar="auto|K"),
)

BY_NAME = {o.name: o for o in OPTIONS}
CONCERNS = ("generation", "budget", "draft", "placement", "precision")


def request_fields(params: dict) -> dict:
    """The Request fields among a command's parsed parameters."""
    return {k: v for k, v in params.items() if k in BY_NAME}


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


def _concern(name: str):
    keys = [(o.field_name, o) for o in OPTIONS if o.concern == name]
    cls = make_dataclass(name.capitalize(), [(k, object, field(default=o.default)) for k, o in keys], frozen=True,
                         namespace={"check": lambda self: _CHECKS[name](self),
                                    "__doc__": f"The {name} options (options.OPTIONS), checked by check()."})
    cls.__module__ = __name__
    return cls


Generation, Budget, Draft, Placement, Precision = (_concern(c) for c in CONCERNS)
CONCERN_CLASSES = dict(zip(CONCERNS, (Generation, Budget, Draft, Placement, Precision)))


def _concerns(self) -> dict:
    """The request split by concern: {"generation": Generation(...), ...}."""
    return {c: cls(**{o.field_name: getattr(self, o.name) for o in OPTIONS if o.concern == c})
            for c, cls in CONCERN_CLASSES.items()}


Request = make_dataclass("Request", [(o.name, object, field(default=o.default)) for o in OPTIONS],
                         namespace={"concerns": _concerns, "__doc__":
                                    "One run as asked, flat: one field per option (options.OPTIONS); what prepare "
                                    "decides is not written back into it."})
Request.__module__ = __name__


def request(model, prompt: str, *concerns) -> "Request":
    """The flat Request that concern configs make (model: a path, a catalog name, a loaded Model, or None)."""
    values = {"model": str(getattr(model, "path", model)) if model is not None else None, "prompt": prompt}
    for c in concerns:
        if c is None:
            continue
        kind = next(k for k, cls in CONCERN_CLASSES.items() if isinstance(c, cls))
        values.update({o.name: getattr(c, o.field_name) for o in OPTIONS if o.concern == kind})
    return Request(**values)


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
    Rule(lambda r: bool(r.precision) and (not r.mem or r.plan_dir or r.rpc or (r.strategy or "stream") != "stream"),
         "--precision auto plans precision with residency under --mem: not with --plan, --rpc or another "
         "--strategy", "the requantized file and its plan are made together under this machine's budget; a saved "
         "plan or a placement across devices was made for another file"),
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
    Rule(lambda r: bool(r.rpc and r.draft), "--rpc and -md: speculation with a draft model runs on this machine only",
         "not built: the draft's placement beside the target's on the servers (free drafters do run with --rpc, "
         "their trees kept under the servers' tiled kernels' 8 rows)"),
)


def check(r) -> None:
    """Each concern's own check, then the checks across concerns: a one-line FlexoffloadError for the first that
    fails."""
    for concern in r.concerns().values():
        concern.check()
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


def options_table() -> str:
    """OPTIONS as a markdown table (docs/options.md): flags, default, commands, concern."""
    rows = ["| option | flags | default | commands | concern |", "| --- | --- | --- | --- | --- |"]
    for o in OPTIONS:
        flags = " ".join(f"`{f}`" for f in o.flags) or "(API only)"
        default = "" if o.name == "n_threads" else repr(o.default)
        rows.append(f"| {o.name} | {flags} | {default} | {', '.join(o.commands)} | {o.concern or 'request'} |")
    return "\n".join(rows)


