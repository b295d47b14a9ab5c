"""Every option once: its flags, type, default, help, the commands that take it and the concern it belongs to (as
llama.cpp's common/arg.cpp declares each flag once with the tools that take it).

From the one table come:
- every command's click options (cli/common.py's `click_options("run")`), in the table's order: a flag declared
  anywhere else fails tests/test_options.py;
- `Request`, the flat form a run is asked in (the command line's, vLLM's EngineArgs), one typed field per option
  but a command's own (concern "command": --json, serve's --port, ...);
- the typed per-concern configs `Generation`, `Budget`, `Draft`, `Placement`, `Precision` (llama.cpp's nested
  common_params); `Request.concerns()` splits a request into them and `request()` flattens them back.
What of them is refused (each concern's check, the rules across concerns) is rules.py's. This module is data: it
imports nothing of flexoffload's above gguf and defaults, so every layer can read it.

A request stays as the user gave it: what `api.prepare` decides travels as its own object (api.Prepared).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, make_dataclass

from flexoffload.defaults import EXPERT_LOOKAHEAD, EXPERT_READS, KV_TYPES, LADDER
from flexoffload.gguf.catalog import DEFAULT_MODEL
from flexoffload.gguf.synth import QTYPES, ROUTINGS

PLACEMENTS = ("auto", "oato", "layers", "split")  # placers.solve's policies
COMMANDS = ("run", "plan", "serve", "bench", "profile")  # the commands that take a Request's options
TOOLS = ("info", "devices", "models list", "models synth")  # the others, each its own flags only
STREAMING = ("run", "plan", "serve")  # the commands that plan a run under a budget


@dataclass(frozen=True)
class Option:
    """One option: `name` is its Request field, `key` its name in its concern's config (default: name)."""
    name: str
    flags: tuple[str, ...]  # click's declarations ("-c", "--ctx-size"); () for an API-only field
    default: object = None
    help: str = ""
    commands: tuple[str, ...] = ("run",)
    concern: str = "generation"  # generation, budget, draft, placement, precision; "" for the request's own;
    # "command" for a command's own flag (--json, serve's --port, ...), not a Request field
    type: type | None = None  # the value's type where the default does not say it (None: the default's)
    choices: tuple[str, ...] | None = None
    minimum: int | None = None  # a whole number at least this
    path: str | None = None  # "dir": a folder path (need not exist); "file": an existing file; "new": a file's
    is_flag: bool = False
    flag_value: object = None  # a negative flag (--no-pacer) sets False; a value's flag given bare (--tune: 3)
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
           COMMANDS + ("info",), "", metavar="MODEL"),
    Option("prompt", ("-p", "--prompt"), "", "prompt text", ("run", "plan", "bench"), "",
           command_defaults={"run": None, "plan": None, "bench": None},  # given or not: -f reads it otherwise
           command_help={"plan": "plan for this prompt (its length sets the prompt's ubatch) [default: one token]",
                         "bench": "prompt text [default: a fixed code prompt]"}),
    Option("chat", ("-cnv", "--conversation"), False,
           "chat at the terminal in the model's chat template, the history kept (-p, -f or -sys: the system "
           "message; -n: each reply's limit, to the end of its turn by default)", ("run",), "", is_flag=True),
    Option("prompt_file", ("-f", "--file"), None, "read the prompt from FILE", ("run", "plan", "profile"), "command",
           metavar="FILE", command_help={"profile": "with --experts: the text to trace [default: HumanEval 0-39 with "
                                         "solutions]"}),
    Option("system_prompt", ("-sys", "--system-prompt"), None, "with -cnv: the system message", ("run",), "command",
           metavar="TEXT"),
    # generation: what to generate, and llama.cpp's context for it
    Option("n_predict", ("-n", "--n-predict"), 128, "tokens to generate (-1: until end of text)",
           ("run", "plan", "bench"), command_defaults={"bench": 32, "plan": 0},
           command_help={"plan": "with --max-prompt: tokens to generate after it"}),
    Option("n_ctx", ("-c", "--ctx-size"), 2048, "context size in tokens", COMMANDS[:4],
           command_defaults={"serve": 4096},
           command_help={"serve": "context cells, shared by the sequences: each has -c / -np"}),
    Option("n_batch", ("-b", "--batch-size"), 512, "prompt tokens per llama_decode call", STREAMING + ("profile",),
           command_defaults={"profile": None},  # its own default by what it measures, said in its help
           command_help={"profile": "with --ops: the prompt ubatch timed [default: 64]; with --experts: the prompt "
                         "ubatch replayed [default: 512]"}),
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
    Option("seed", ("--seed",), -1, "sampling seed (-1: random)", ("run", "models synth"),
           command_defaults={"models synth": 0}, command_help={"models synth": "the random weights' seed"}),
    Option("verbose", ("-v", "--verbose"), False, "show llama.cpp's log", ("run", "serve"), is_flag=True),
    # budget: the memory budget and how weights reach memory
    Option("mem", ("--mem",), None, "memory budget for the whole process: 400M, 1.5G, or 0.4x of the model's size "
           "(per device with --rpc: cpu=SIZE,rpc0=SIZE,...)", STREAMING + ("bench",), "budget",
           required_by=("plan", "bench"), command_help={"bench": "comma-separated budgets: 400M,0.5x,1.0x"}),
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
    Option("draft_head", ("--draft-head",), "auto", "the draft's output head: whole, cut to the 32,768 tokens a "
           "corpus uses most (FR-Spec: a copy made once and cached; a token outside it is never drafted), or auto: "
           "whichever is predicted faster by the memory and steps it saves", ("run", "plan"), "draft",
           choices=("auto", "full", "cut"), key="head"),
    Option("spec_control", ("--spec-control",), "measured", "what sizes a draft model's trees: the acceptance and "
           "costs the run measures (depth by acceptance, the draft off where it loses), or LLMCad's confidence "
           "rules (the reproduction's)", ("run",), "draft", choices=("measured", "llmcad"), key="control"),
    Option("history", ("--no-history",), True, "neither read nor write the stored acceptance history of this "
           "model pair (the run starts from the prior)", ("run", "plan"), "draft", is_flag=True, flag_value=False),
    # placement: RPC servers
    Option("rpc", ("--rpc",), None, "RPC servers (ggml-rpc-server) to place weights on: by --plan, by -ngl, or "
           "placed now with --mem (cpu=SIZE,rpc0=SIZE,...)", STREAMING + ("profile", "devices"), "placement",
           metavar="HOST:PORT,...",
           command_help={"profile": "with --ops: each RPC server's device as well (its compute against this CPU's, a "
                         "visit's cost, its link), from whole tokens with layers placed on it",
                         "devices": "RPC servers (ggml-rpc-server) to ask as well"}),
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
    # a command's own (concern "command": not a Request field)
    Option("enforce", ("--enforce",), False, "hold the run to --mem with a memory cgroup and report its peak",
           ("run", "serve"), "command", is_flag=True,
           command_help={"serve": "hold the server to --mem with a memory cgroup"}),
    Option("as_json", ("--json",), False, "print JSON instead of text", ("run", "plan", "profile", "info",
           "devices", "models list"), "command", is_flag=True,
           command_help={"run": "print one JSON object instead of text and timings",
                         "info": "print the table as JSON", "devices": "print the devices as JSON"}),
    Option("out_dir", ("-o", "--output"), None, "directory for tensors.ot, plan.json and run.json (what run --plan "
           "DIR then runs)", ("plan",), "command", path="dir"),
    Option("output", ("-o", "--output"), None, "write the table as CSV", ("bench", "models synth"), "command",
           path="new", required_by=("models synth",), command_help={"models synth": "where to write the GGUF"}),
    # serve's
    Option("n_parallel", ("-np", "--parallel"), 4, "sequences decoded together (requests beyond wait)", ("serve",),
           "command"),
    Option("host", ("--host",), "127.0.0.1", "address(es) to listen on, comma-separated", ("serve",), "command"),
    Option("port", ("--port",), 8080, "port to listen on (0: any free one)", ("serve",), "command"),
    Option("api_key", ("--api-key",), None, "every endpoint but /health needs `Authorization: Bearer KEY`",
           ("serve",), "command", envvar="FLEXOFFLOAD_API_KEY"),
    Option("queue", ("--queue",), 32, "requests that may wait for a sequence; beyond, 503", ("serve",), "command"),
    Option("tiled", ("--tiled",), False, "llama.cpp's tiled kernels for passes of 8 rows or more: faster with 8 or "
           "more requests decoding (26 % at 8 in one session), but a greedy text may then differ from run's at a "
           "near tie (default: row by row, every request's text run's)", ("serve",), "command", is_flag=True),
    # bench's
    Option("strategies", ("--strategies",), "mmap", "comma-separated strategies", ("bench",), "command"),
    Option("repetitions", ("-r", "--repetitions"), 3, "runs of each budget and strategy, in turn", ("bench",),
           "command"),
    # plan's
    Option("tune", ("--tune",), None, "measure the N best predicted plans (3) and every baseline policy under "
           "the enforced budget, keep the fastest (run --mem then uses it)", ("plan",), "budget", type=int,
           flag_value=3, metavar="[N]"),
    Option("tune_rounds", ("--tune-rounds",), 2, "runs of each candidate, in turn", ("plan",), "budget",
           minimum=1),
    Option("max_prompt", ("--max-prompt",), False, "report the longest prompt --mem holds (and the ubatch it needs), "
           "instead of writing a plan", ("plan",), "command", is_flag=True),
    Option("prompt_len", ("--prompt-len",), None, "report a prefill of L tokens step by step at each ubatch "
           "(memory: its peak and what it leaves)", ("plan",), "command", type=int, metavar="L"),
    # profile's
    Option("remeasure", ("--remeasure",), False, "measure again even if a profile is cached", ("profile",),
           "command", is_flag=True),
    Option("ops", ("--ops",), False, "time every weight's operator (MUL_MAT, GET_ROWS) for a decoded token and a "
           "prompt ubatch", ("profile",), "command", is_flag=True),
    Option("sensitivity", ("--precision",), False, "measure the harm of each lower type per group of tensors (KL "
           "divergence, UQEst) for plan --precision auto", ("profile",), "command", is_flag=True),
    Option("n_groups", ("--groups",), 4, "with --precision: layer groups per kind", ("profile",), "command"),
    Option("ladder", ("--types",), ",".join(LADDER), "with --precision: the lower types a tensor may take",
           ("profile",), "command"),
    Option("experts", ("--experts",), False, "a mixture of experts: record which experts a text routes to (cached) "
           "and replay it through an expert cache: hit rate by policy, Belady's bound, bytes read and tok/s "
           "predicted", ("profile",), "command", is_flag=True),
    Option("slots", ("--slots",), None, "with --experts: cache sizes, in experts a layer [default: none, one "
           "token's, a quarter, half, three quarters of the experts]", ("profile",), "command", metavar="N,N,..."),
    Option("neurons", ("--neurons",), False, "a dense model's FFN neurons as a hot set and groups a predictor picks "
           "(cached): at each level, the KL divergence, the bytes a token reads and the predictor's recall, for run "
           "--sparsity", ("profile",), "command", is_flag=True),
    Option("neuron_groups", ("--neuron-groups",), None, "with --neurons: groups a layer [32]", ("profile",),
           "command", minimum=1),
    Option("levels", ("--levels",), None, "with --neurons: the groups a token reads, measured [default: "
           "16,20,24,28,30,32 of 32]", ("profile",), "command", metavar="K,K,..."),
    # devices'
    Option("links", ("--links",), False, "with --rpc: time each server's link (round trip, MB/s each way)",
           ("devices",), "command", is_flag=True),
    # models synth's
    Option("qtype", ("--qtype",), "Q4_0", "the 2-D weights' type", ("models synth",), "command", choices=QTYPES),
    Option("routing", ("--routing",), "random", "a mixture of experts' routers: random weights (a cache's best "
           "case) or by the token (text-like)", ("models synth",), "command", choices=ROUTINGS),
    Option("tokenizer", ("--tokenizer",), None, "copy this model's vocabulary (a GGUF or a catalog name), so real "
           "text tokenizes as it would for it", ("models synth",), "command", metavar="MODEL"),
)

BY_NAME = {o.name: o for o in OPTIONS}
CONCERNS = ("generation", "budget", "draft", "placement", "precision")
REQUEST_OPTIONS = tuple(o for o in OPTIONS if o.concern != "command")


def request_fields(params: dict) -> dict:
    """The Request fields among a command's parsed parameters."""
    return {k: v for k, v in params.items() if k in BY_NAME and BY_NAME[k].concern != "command"}


def value_type(o: Option):
    """An option's value type: given, or its default's (a flag's bool); None where it may be left out."""
    t = o.type or (int if o.minimum is not None else None) or (bool if o.is_flag else None) \
        or (type(o.default) if o.default is not None else str)
    return t | None if o.default is None else t


def _concern(name: str):
    keys = [(o.field_name, o) for o in OPTIONS if o.concern == name]
    cls = make_dataclass(name.capitalize(), [(k, value_type(o), field(default=o.default)) for k, o in keys],
                         frozen=True, namespace={"__doc__": f"The {name} options (options.OPTIONS); "
                                                            "rules.check_concern checks them."})
    cls.__module__ = __name__
    return cls


Generation, Budget, Draft, Placement, Precision = (_concern(c) for c in CONCERNS)
CONCERN_CLASSES = dict(zip(CONCERNS, (Generation, Budget, Draft, Placement, Precision)))


def _concerns(self) -> dict:
    """The request split by concern: {"generation": Generation(...), ...}."""
    return {c: cls(**{o.field_name: getattr(self, o.name) for o in OPTIONS if o.concern == c})
            for c, cls in CONCERN_CLASSES.items()}


Request = make_dataclass("Request", [(o.name, value_type(o), field(default=o.default)) for o in REQUEST_OPTIONS],
                         namespace={"concerns": _concerns, "__doc__":
                                    "One run as asked, flat: one field per option (options.OPTIONS); what prepare "
                                    "decides is not written back into it."})
Request.__module__ = __name__


def request_for(command: str, **fields) -> "Request":
    """A Request with a command's own defaults where the table names one (serve's -c 4096, plan's -n 0), the API's
    way to ask what that command would: fields given win."""
    named = {o.name: o.command_defaults[command] for o in REQUEST_OPTIONS
             if command in o.command_defaults and o.command_defaults[command] is not None}
    return Request(**{**named, **fields})


def request(model, prompt: str, *concerns) -> "Request":
    """The flat Request that concern configs make (model: a path, a catalog name, a loaded Model, or None)."""
    values = {"model": str(getattr(model, "path", model)) if model is not None else None, "prompt": prompt}
    for c in concerns:
        if c is None:
            continue
        kind = next(k for k, cls in CONCERN_CLASSES.items() if isinstance(c, cls))
        values.update({o.name: getattr(c, o.field_name) for o in OPTIONS if o.concern == kind})
    return Request(**values)


def options_table() -> str:
    """OPTIONS as a markdown table (docs/options.md): flags, default, commands, concern."""
    rows = ["| option | flags | default | commands | concern |", "| --- | --- | --- | --- | --- |"]
    for o in OPTIONS:
        flags = " ".join(f"`{f}`" for f in o.flags) or "(API only)"
        concern = {"": "request", "command": "the command's own"}.get(o.concern, o.concern)
        default = "" if o.name == "n_threads" else repr(o.default)
        default += "".join(f" ({c}: {v!r})" for c, v in o.command_defaults.items())
        rows.append(f"| {o.name} | {flags} | {default} | {', '.join(o.commands)} | {concern} |")
    return "\n".join(rows)


