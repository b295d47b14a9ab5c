r"""A plan: which tensors stay resident and which stream, the memory it takes, the speed it predicts; its files.

`write` puts a plan in a directory as two files:
- tensors.ot: llama.cpp's --override-tensor syntax, one `regex=STREAMED` a line, sending the streamed tensors to
  the streaming patch's buffer type. The loader (src/llama-model-loader.cpp, the tensor_buft_overrides loop) tries
  each tensor name against the patterns in order with std::regex_search, a match anywhere in the name, and the
  first match wins; so every pattern is anchored ^…$ with its dots escaped (unanchored, `blk\.1\.ffn_up` would
  also take blk.1.ffn_up_shexp.weight, and an unescaped dot matches any character). One line covers a kind
  across layers (`^blk\.(0|1|2)\.ffn_up\.weight$`, or `\d+` when it streams in every layer), and kinds streamed
  in the same layers share a line. Patterns hold no ',' or '=': the -ot parser splits on them.
  A tensor placed on another device (an RPC server, a GPU) gets a line `regex=BUFT` with that device's buffer type
  name as llama.cpp registers it (`RPC0[10.0.0.2:50052]`, `CUDA0`), written the same way.
- plan.json: everything, human readable (the streamed and placed lists too, so `read` can check tensors.ot against
  them).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.plan.costmodel import Profile, looked_up_only, row_bytes
from flexoffload.plan.dimensions import Experts, Placed, Precision

STREAMED_BUFT = "STREAMED"  # the name the streaming patch registers its buffer type under
CPU_BUFT = "CPU"  # the CPU's own: an override sending a tensor a layer assignment put on a device back to the host
OVERRIDES_FILE = "tensors.ot"
PLAN_FILE = "plan.json"

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class Memory:
    """Where the budget goes, in bytes."""

    resident: int  # weights kept in memory
    window: int  # prefetch buffers for the streamed tensors
    kv_cache: int
    compute: int  # compute buffers
    overhead: int  # the heap, the runtime's anonymous memory, the kernel's, a margin (and a resident draft model)
    code: int = 0  # the runtime's file pages (libraries): reclaimable, but the run faults them back in
    experts: int = 0  # a mixture of experts' expert cache, and the experts a batch holds beyond it (expertcache.py)

    @property
    def total(self) -> int:
        return self.unreclaimable + self.code

    @property
    def unreclaimable(self) -> int:
        """What the run holds that reclaim cannot take back (the matrix's measured peak is of this)."""
        return self.resident + self.window + self.kv_cache + self.compute + self.overhead + self.experts


@dataclass(frozen=True)
class Plan:
    model: str  # path of the GGUF
    policy: str
    budget: int  # bytes for the whole process
    memory: Memory
    resident: tuple[str, ...]  # tensor names, file order
    streamed: tuple[str, ...]
    window: int  # prefetch window (layers read ahead of the one computing)
    io_threads: int
    predicted_tok_s: float
    roofline_tok_s: float
    profile: Profile | None = None  # the profile the prediction used
    tuning: tuple = ()  # plan --tune: every candidate's policy, window, predicted and measured tok/s (tune.py)
    placed: tuple[tuple[str, str], ...] = ()  # (resident tensor, buffer type) for those an override sends to another
    # device, or back to the CPU (their bytes are not in memory.resident: that is this machine's)
    placement: Placed | None = None  # across devices (placement.py): -ngl, -ts, the devices' predicted time,
    # memory and transfer; tensors the layer assignment puts on a device are resident here too, at no bytes
    precision: Precision | None = None  # plan --precision auto (mixed.py): the source file, the types changed, the
    # predicted and measured quality; `model` is then the requantized file
    experts: Experts | None = None  # a mixture of experts: the expert cache's slots per layer and policy, the hit
    # rate, expert bytes read per token and the seconds they add that the plan predicts (expertcache.py)

    def write(self, directory: str | os.PathLike) -> Path:
        """Write the plan's files (tensors.ot, plan.json) into directory: `run --plan DIRECTORY` streams by them."""
        return write(self, directory)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["memory"]["total"] = self.memory.total
        d["resident"], d["streamed"] = list(self.resident), list(self.streamed)
        d["placed"] = [list(p) for p in self.placed]
        d["profile"] = self.profile.to_dict() if self.profile else None
        d["tuning"] = [dict(t) for t in self.tuning]
        for key in ("placement", "precision", "experts"):  # each record's JSON, as plan.json has always had it
            record = getattr(self, key)
            d[key] = record.to_dict() if record is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        memory = {k: v for k, v in d["memory"].items() if k != "total"}
        profile = Profile.from_dict(d["profile"]) if d.get("profile") else None
        return cls(**{**d, "memory": Memory(**memory), "resident": tuple(d["resident"]),
                      "streamed": tuple(d["streamed"]), "profile": profile, "tuning": tuple(d.get("tuning", ())),
                      "placed": tuple(tuple(p) for p in d.get("placed", ())),
                      "placement": Placed.from_dict(d["placement"]) if d.get("placement") else None,
                      "precision": Precision.from_dict(d["precision"]) if d.get("precision") else None,
                      "experts": Experts.from_dict(d["experts"]) if d.get("experts") else None})


def streamed_bytes(plan: Plan, model) -> int:
    """Bytes a decode pass reads from disk under the plan: the streamed tensors' sizes, but for a tensor only looked
    up (a streamed token_embd the output is not tied to) the one row a token looks up, and of expert tensors the
    routed experts the expert cache is predicted to miss."""
    streamed = set(plan.streamed)
    experts = plan.experts.bytes_per_token if plan.experts is not None else 0  # the routed experts the cache lacks
    return experts + sum(row_bytes(t) if looked_up_only(model, t) else t.n_bytes for t in model.tensors
                         if t.name in streamed and t.kind != "expert")


def _escape(text: str) -> str:
    """Escape for both ECMAScript (std::regex) and Python; ',' and '=' as hex escapes for the -ot parser."""
    text = re.sub(r"([.^$*+?()\[\]{}|\\])", r"\\\1", text)
    return text.replace(",", r"\x2c").replace("=", r"\x3d")


def _alternation(items: list[str]) -> str:
    return items[0] if len(items) == 1 else "(" + "|".join(items) + ")"


def override_patterns(streamed: list[str], names: list[str]) -> list[str]:
    """Regexes matching exactly the streamed names among `names` (all the model's tensors), few and readable.

    Names outside the layers get a line each. A layer tensor kind (the name after `blk.N.`) is written for the
    layers it streams in, `\\d+` when it streams in every layer that has it; kinds with the same layer pattern
    share a line.
    """
    streamed_set = set(streamed)
    layers_of: dict[str, list[int]] = {}  # suffix -> layers having it, file order
    for name in names:
        m = _LAYER.match(name)
        if m:
            layers_of.setdefault(m.group(2), []).append(int(m.group(1)))
    lines: dict[str, list[str]] = {}  # layer pattern -> suffixes, first seen first
    done, patterns = set(), []
    for name in names:
        if name not in streamed_set:
            continue
        m = _LAYER.match(name)
        if not m:
            patterns.append(f"^{_escape(name)}$")
            continue
        suffix = m.group(2)
        if suffix in done:
            continue
        done.add(suffix)
        layers = sorted({layer for layer in layers_of[suffix] if f"blk.{layer}.{suffix}" in streamed_set})
        every = len(layers) == len(set(layers_of[suffix]))
        lines.setdefault(r"\d+" if every else _alternation([str(x) for x in layers]), []).append(suffix)
    for layers, suffixes in lines.items():
        if all(s.endswith(".weight") for s in suffixes):
            kinds = _alternation([_escape(s.removesuffix(".weight")) for s in suffixes]) + r"\.weight"
        else:
            kinds = _alternation([_escape(s) for s in suffixes])
        patterns.append(rf"^blk\.{layers}\.{kinds}$")
    return patterns


def overrides(plan: Plan) -> list[tuple[str, str]]:
    """(pattern, buffer type) for the plan's streamed tensors, then for those placed on each device."""
    names = list(plan.resident) + list(plan.streamed)
    pairs = [(p, STREAMED_BUFT) for p in override_patterns(list(plan.streamed), names)]
    for buft in dict.fromkeys(b for _, b in plan.placed):  # devices in the order first placed
        pairs += [(p, buft) for p in override_patterns([n for n, b in plan.placed if b == buft], names)]
    return pairs


def write(plan: Plan, directory: str | os.PathLike) -> Path:
    """Write tensors.ot and plan.json into directory (made if missing); returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / OVERRIDES_FILE).write_text("".join(f"{p}={b}\n" for p, b in overrides(plan)))
    (directory / PLAN_FILE).write_text(json.dumps(plan.to_dict(), indent=1) + "\n")
    return directory


def read_overrides(path: str | os.PathLike) -> list[tuple[str, str]]:
    """(pattern, buffer type) per line of a tensors.ot, split at the first '=' as llama.cpp's -ot parser does."""
    pairs = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            pattern, sep, buft = line.partition("=")
            if not sep:
                raise FlexoffloadError(f"{path}: line without '=': {line!r}")
            pairs.append((pattern, buft))
    return pairs


def buffer_types_by(pairs: list[tuple[str, str]], names: list[str]) -> dict[str, str]:
    """The buffer type an override list gives each name it matches, matched as llama.cpp does (regex_search,
    first matching pattern wins)."""
    compiled = [(re.compile(p), b) for p, b in pairs]
    found = {n: next((b for p, b in compiled if p.search(n)), None) for n in names}
    return {n: b for n, b in found.items() if b is not None}


def streamed_by(pairs: list[tuple[str, str]], names: list[str]) -> list[str]:
    """The names an override list sends to the streamed buffer type."""
    bufts = buffer_types_by(pairs, names)
    return [n for n in names if bufts.get(n) == STREAMED_BUFT]


def read(directory: str | os.PathLike) -> Plan:
    """The plan in directory; checks that its tensors.ot streams exactly the plan's streamed tensors."""
    directory = Path(directory)
    try:
        plan = Plan.from_dict(json.loads((directory / PLAN_FILE).read_text()))
        pairs = read_overrides(directory / OVERRIDES_FILE)
    except FileNotFoundError as e:
        raise FlexoffloadError(f"not a plan directory ({e.filename} missing): {directory}") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise FlexoffloadError(f"damaged {PLAN_FILE} in {directory}: {e}") from None
    names = list(plan.resident) + list(plan.streamed)
    if streamed_by(pairs, names) != [n for n in names if n in set(plan.streamed)]:
        raise FlexoffloadError(f"{directory / OVERRIDES_FILE} does not stream exactly the plan's streamed tensors")
    placed = {n: b for n, b in buffer_types_by(pairs, names).items() if b != STREAMED_BUFT}
    if placed != dict(plan.placed):
        raise FlexoffloadError(f"{directory / OVERRIDES_FILE} does not place exactly the plan's placed tensors")
    return plan
