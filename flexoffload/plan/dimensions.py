"""A plan's dimensions beside residency, each a record plan.json keeps under its key: `placement` (weights across
devices: placement.py), `precision` (plan --precision auto: mixed.py, api/precision.py) and `experts` (a mixture
of experts' expert reads: expertcache.py). Each writes its key's JSON as it always has (`to_dict`) and reads it back
(`from_dict`), so plan folders written before these records load unchanged.

`Placement` and its predicted `Cost` live here rather than in placement.py, which plans.py cannot import
(placement.py imports plans.py); placement.py imports them back, and its callers import them from there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class Placement:
    """Where the weights go, in llama.cpp's terms (-ngl, -ts, -ot)."""

    policy: str
    devices: tuple[str, ...]  # buffer type names, in llama.cpp's device order
    n_gpu_layers: int = 0
    tensor_split: tuple[float, ...] = ()  # per device; () splits as upstream does (by free memory: equal here)
    placed: tuple[tuple[str, str], ...] = ()  # (tensor, buffer type) overrides beyond the layers' assignment

    def to_dict(self) -> dict:
        return {"policy": self.policy, "devices": list(self.devices), "n_gpu_layers": self.n_gpu_layers,
                "tensor_split": list(self.tensor_split), "placed": [list(p) for p in self.placed]}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Placement":
        return cls(policy=d["policy"], devices=tuple(d["devices"]), n_gpu_layers=d["n_gpu_layers"],
                   tensor_split=tuple(d["tensor_split"]), placed=tuple(tuple(p) for p in d["placed"]))

    def llama_args(self) -> list[str]:
        """The flags llama.cpp's own tools take for this placement (beside --rpc and -ot tensors.ot)."""
        args = ["-ngl", str(self.n_gpu_layers)]
        if self.tensor_split:
            args += ["-ts", ",".join(f"{x:g}" for x in self.tensor_split)]
        return args


@dataclass(frozen=True)
class Cost:
    """A placement's predicted time per decoded token, and where it goes."""

    seconds_per_token: float
    device_compute_s: tuple[float, ...]  # per device: its operators' time a token
    host_compute_s: float  # the host's operators (its streaming reads are apart, overlapped by the pipeline)
    visits: int  # how often a token's graph moves to a device and back
    transfer_s: float  # the visits' fixed cost and the activations' and logits' bytes
    transfer_bytes: int

    @property
    def tok_s(self) -> float:
        return 1.0 / self.seconds_per_token

    def to_dict(self) -> dict:
        d = asdict(self)
        d["device_compute_s"] = list(self.device_compute_s)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Cost":
        return cls(**{**d, "device_compute_s": tuple(d["device_compute_s"])})


@dataclass(frozen=True)
class Share:
    """One device's part of a placed plan."""

    name: str  # its buffer type's name
    budget: int  # the memory given it (--mem rpc0=...), bytes
    memory: int  # what the placement takes on it, bytes
    compute_s: float  # its operators' time a token


@dataclass(frozen=True, kw_only=True)
class Placed(Placement):
    """A placement as its plan keeps it: the placement, what it is predicted to cost a token, each device's part.
    plan.json adds the placement's llama.cpp flags (llama_args), for a reader."""

    cost: Cost
    per_device: tuple[Share, ...]

    @classmethod
    def of(cls, placement: Placement, cost: Cost, per_device: tuple[Share, ...]) -> "Placed":
        return cls(**{f.name: getattr(placement, f.name) for f in fields(Placement)}, cost=cost,
                   per_device=tuple(per_device))

    def to_dict(self) -> dict:
        return {**super().to_dict(), "cost": self.cost.to_dict(), "per_device": [asdict(s) for s in self.per_device],
                "llama_args": self.llama_args()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Placed":
        return cls.of(Placement.from_dict(d), Cost.from_dict(d["cost"]), tuple(Share(**s) for s in d["per_device"]))


@dataclass(frozen=True)
class Alternative:
    """A uniform point the precision walk was checked against: every measured group lowered to one type."""

    type: str
    predicted_kld: float
    weight_bytes: int
    predicted_tok_s: float


@dataclass(frozen=True)
class Precision:
    """plan --precision auto's choice: the plan's `model` is then the requantized file, this is how it was made."""

    source: str  # the file requantized (the one the user named)
    original: str | None  # the original weights it was quantized from instead, where given
    types: dict[str, str]  # tensor name -> its new type, for the tensors lowered
    steps: tuple[tuple[str, str], ...]  # the walk's (group, type) steps taken, in order
    weight_bytes: int  # the requantized file's weights
    source_weight_bytes: int
    predicted_kld: float  # KL divergence summed over the groups lowered
    predicted_uqest_delta: float
    walk_tok_s: float  # the walk's prediction for the point chosen
    own_types_tok_s: float  # the walk's prediction for the source's own types
    alternatives: tuple[Alternative, ...]
    max_kld: float | None  # the bound it was chosen within (plan.json: "bound")
    min_tok_s: float | None
    measured: dict[str, float] | None = None  # the requantized file's quality (sensitivity.quality); None: not measured
    walk: tuple[dict, ...] = ()  # the walk's points ({steps, kld, weight_bytes, predicted_tok_s}), the first its own

    def to_dict(self) -> dict:
        d = {"source": self.source, "original": self.original, "types": dict(self.types),
             "steps": [list(s) for s in self.steps], "weight_bytes": self.weight_bytes,
             "source_weight_bytes": self.source_weight_bytes, "predicted_kld": self.predicted_kld,
             "predicted_uqest_delta": self.predicted_uqest_delta, "walk_tok_s": self.walk_tok_s,
             "own_types_tok_s": self.own_types_tok_s, "alternatives": [asdict(a) for a in self.alternatives],
             "bound": {"max_kld": self.max_kld, "min_tok_s": self.min_tok_s}}
        if self.measured is not None:
            d["measured"] = dict(self.measured)
        if self.walk:
            d["walk"] = [dict(x) for x in self.walk]
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Precision":
        bound = d.get("bound") or {}
        return cls(source=d["source"], original=d.get("original"), types=dict(d["types"]),
                   steps=tuple(tuple(s) for s in d["steps"]), weight_bytes=d["weight_bytes"],
                   source_weight_bytes=d["source_weight_bytes"], predicted_kld=d["predicted_kld"],
                   predicted_uqest_delta=d["predicted_uqest_delta"], walk_tok_s=d["walk_tok_s"],
                   own_types_tok_s=d["own_types_tok_s"],
                   alternatives=tuple(Alternative(**a) for a in d.get("alternatives", ())),
                   max_kld=bound.get("max_kld"), min_tok_s=bound.get("min_tok_s"), measured=d.get("measured"),
                   walk=tuple(dict(x) for x in d.get("walk", ())))


@dataclass(frozen=True)
class Experts:
    """How a mixture of experts' plan reads its experts: by expert, into a cache of `slots` a layer (what the plan
    predicts it hits and reads), or (whole) its expert tensors streamed whole by the window like dense tensors."""

    slots: int  # experts each layer keeps between tokens (0 where whole)
    policy: str  # which cached expert the cache gives back first: lru or lfu (expertcache.POLICIES)
    hit_rate: float  # predicted share of a token's routed experts found cached (0 where whole)
    bytes_per_token: float  # expert bytes read a token: the predicted misses, or (whole) the streamed expert tensors
    seconds: float  # what the experts add to a decoded token's time
    whole: bool = False
    ahead: bool = False  # a prompt batch reads the next layer's experts ahead (its memory counted)
    lookahead: bool = False  # a decoded token's next layer's experts, predicted by its router, read a layer early

    def to_dict(self) -> dict:
        d = {"slots": self.slots, "policy": self.policy}
        if self.whole:  # written only where true, as before
            d["whole"] = True
        if self.ahead:
            d["ahead"] = True
        if self.lookahead:
            d["lookahead"] = True
        return {**d, "hit_rate": self.hit_rate, "bytes_per_token": self.bytes_per_token, "seconds": self.seconds}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Experts":
        return cls(slots=d["slots"], policy=d["policy"], hit_rate=d["hit_rate"], bytes_per_token=d["bytes_per_token"],
                   seconds=d["seconds"], whole=bool(d.get("whole", False)), ahead=bool(d.get("ahead", False)),
                   lookahead=bool(d.get("lookahead", False)))
