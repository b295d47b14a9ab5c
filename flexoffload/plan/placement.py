"""Placements of weights across devices, and what the cost model predicts for them (OATO's scheduler, issue 15).

A placement says, for each weight, where it lives: on this machine (resident, or streamed from disk by the host's
own plan) or on a device (an RPC server, a GPU). It is given to llama.cpp the way its own tools take it:
- `n_gpu_layers` and `tensor_split` (-ngl, -ts): llama.cpp's layer assignment, mirrored by `layer_devices`. The
  last n_gpu_layers "layers" go to the devices, the output head counting as one (the one after the last block),
  split among them in proportion to tensor_split; each block's KV cache and its whole compute go with it.
- `placed` (-ot, tensors.ot): single tensors sent to a device's buffer type (or back to the CPU's), beyond that.
  A block's attention then still computes where its KV cache is.

The prediction (`predict`) walks a decoded token's operators in graph order: every weight's operator computes where
its weight is, a block's attention where its KV cache is, and norms with their own weight. Each time the graph
moves to another device and back it pays that device's `visit_s` (the scheduler's copies and the RPC round trips
of a split) and the activation's bytes over the link; when the output head is on a device, the logits come back
(n_vocab floats a token: 0.6 MB on the Qwen models, ~5 ms at 1 Gbit/s). An operator on a device takes its host
compute time times the device's `compute_ratio`. Both are measured per device (opprofile.measure_device). Those
times are added to the host pipeline's stages (costmodel), so streaming on the host overlaps them as it overlaps
host compute.

A saved plan is checked against the model and budget of a run here too (`check_fits`): the tensors its placement
puts on devices (`on_devices`) are not this machine's memory.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import LOAD_PIECE_BYTES
from flexoffload.gguf.model import Model, Tensor
from flexoffload.memory.budgets import format_size
from flexoffload.plan.costmodel import Pipeline, Profile
# Placement and Cost are the plan's records (dimensions.py, which plans.py reads); importable from here as before
from flexoffload.plan.dimensions import Cost, Placed, Placement, Share
from flexoffload.plan.pipeline import simulate
from flexoffload.plan.plans import CPU_BUFT, Memory, Plan

HOST = -1  # the device index of this machine's CPU


@dataclass(frozen=True)
class DeviceProfile:
    """A device as the cost model sees it: measured by opprofile.measure_device, or written by hand
    (profiles/*.json: a hypothetical GPU)."""

    name: str  # its buffer type's name: RPC0[10.77.0.2:50052], CUDA0
    compute_ratio: float  # an operator's time on it over its time on this machine's CPU
    visit_s: float  # seconds each time the graph moves to it and back, beside the bytes
    bandwidth: float  # bytes/s of its link, each way
    kind_ratio: Mapping[str, float] = field(default_factory=dict)  # by tensor kind, where it differs (a GPU)
    launch_s: float = 0.0  # seconds added to every operator it computes (a GPU kernel's launch)

    def ratio(self, kind: str) -> float:
        return self.kind_ratio.get(kind, self.compute_ratio)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kind_ratio"] = dict(self.kind_ratio)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "DeviceProfile":
        return cls(**{**d, "kind_ratio": dict(d.get("kind_ratio", {}))})

    @classmethod
    def read(cls, path: str | Path, name: str | None = None) -> "DeviceProfile":
        try:
            d = json.loads(Path(path).read_text())
            return replace(cls.from_dict(d["device"] if "device" in d else d), **({"name": name} if name else {}))
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise FlexoffloadError(f"not a device profile: {path} ({e})") from None


def layer_devices(n_layer: int, n_gpu_layers: int, tensor_split: tuple[float, ...], n_devices: int) -> list[int]:
    """The device of each block and then of the output head (index n_layer), HOST for the CPU: llama.cpp's
    get_layer_buft_list (src/llama-model.cpp), with an empty split as equal shares."""
    if n_devices == 0 or n_gpu_layers <= 0:
        return [HOST] * (n_layer + 1)
    split = list(tensor_split) if tensor_split and any(tensor_split) else [1.0] * n_devices
    total, points = 0.0, []
    for x in split:
        total += x
        points.append(total)
    points = [p / total for p in points]
    start = max(n_layer + 1 - n_gpu_layers, 0)
    active = min(n_gpu_layers, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= active:
            out.append(HOST)
            continue
        position = (il - start) / active
        out.append(next((j for j, p in enumerate(points) if p > position), n_devices - 1))
    return out


def tensor_devices(model: Model, placement: Placement) -> dict[str, int]:
    """The device index of every weight under a placement (token_embd, the input, always starts on the host)."""
    layers = layer_devices(model.n_layer, placement.n_gpu_layers, placement.tensor_split, len(placement.devices))
    index = {name: i for i, name in enumerate(placement.devices)}
    index[CPU_BUFT] = HOST
    out = {}
    for t in model.tensors:
        if t.layer is not None:
            out[t.name] = layers[t.layer]
        elif t.kind == "token_embd":
            out[t.name] = HOST
        else:
            out[t.name] = layers[model.n_layer]
    for name, buft in placement.placed:
        if buft not in index:
            raise FlexoffloadError(f"the placement sends {name} to {buft}, not one of its devices")
        out[name] = index[buft]
    return out


def output_device(model: Model, placement: Placement, where: Mapping[str, int]) -> int:
    """Where the output matrix multiplies: output.weight's device, or where a tied token_embd's copy goes (llama.cpp
    duplicates it onto the output head's device)."""
    if not model.tied_embeddings:
        return next(where[t.name] for t in model.tensors if t.kind == "output")
    index = {name: i for i, name in enumerate(placement.devices)}
    for name, buft in placement.placed:  # the copy has token_embd's name: an override of it moves the copy too
        if name == "token_embd.weight":
            return index.get(buft, HOST)
    return layer_devices(model.n_layer, placement.n_gpu_layers, placement.tensor_split,
                         len(placement.devices))[model.n_layer]


def head_home(model: Model) -> tuple[tuple[str, str], ...]:
    """Overrides keeping the output head on the host whatever the layer assignment: output_norm and the output
    matrix (for tied embeddings, token_embd: its copy has its name, and the input lookup stays on the host)."""
    return tuple((t.name, CPU_BUFT) for t in model.tensors
                 if t.layer is None and (t.kind != "token_embd" or model.tied_embeddings))


def kv_devices(model: Model, placement: Placement) -> list[int]:
    """Each block's KV cache's device: the block's, as llama.cpp assigns it (overrides move weights only)."""
    return layer_devices(model.n_layer, placement.n_gpu_layers, placement.tensor_split,
                         len(placement.devices))[:model.n_layer]


# A block's operators in a decoded token's graph order: (the weight kinds an operator uses, whether it is the
# attention over the KV cache). q, k and v read the same normed input; the biases go with their matrices.
BLOCK_ORDER = (("attn_norm",), ("attn_q",), ("attn_k",), ("attn_v",), ("attention",), ("attn_output",),
               ("ffn_norm",), ("ffn_gate",), ("ffn_up",), ("ffn_down",))


class Walk:
    """A placement's decoded token, operator by operator: what each device computes, and the visits between."""

    def __init__(self, model: Model, placement: Placement, devices: list[DeviceProfile], profile: Profile):
        if [d.name for d in devices] != list(placement.devices):
            raise FlexoffloadError("the device profiles do not match the placement's devices")
        self.where = tensor_devices(model, placement)
        kv = kv_devices(model, placement)
        self.devices, self.profile = devices, profile
        self.compute = [0.0] * len(devices)
        self.host = 0.0
        self.by_stage: dict[str, float] = {}  # what to add to each host pipeline stage: device time and visits
        self.visits, self.transfer_s, self.transfer_bytes = 0, 0.0, 0
        activation = model.n_embd * 4
        by_layer: dict[int, dict[str, list[Tensor]]] = {}
        for t in model.tensors:
            if t.layer is not None:
                kind = t.kind if t.kind not in ("norm", "bias") else _owner(t.name)
                by_layer.setdefault(t.layer, {}).setdefault(kind, []).append(t)
        current = HOST  # the input lookup (token_embd) computes on the host
        for layer in range(model.n_layer):
            stage = f"blk.{layer}"
            for (kind,) in BLOCK_ORDER:
                if kind == "attention":
                    device, seconds = kv[layer], profile.layer_overhead
                else:
                    tensors = by_layer.get(layer, {}).get(kind, [])
                    if not tensors:
                        continue
                    weight = max(tensors, key=lambda x: x.n_bytes)
                    device = self.where[weight.name]
                    seconds = sum(profile.compute_seconds(x) for x in tensors)
                current = self._step(stage, current, device, kind, seconds, activation)
        head = sorted((t for t in model.tensors if t.layer is None and t.kind != "token_embd"),
                      key=lambda x: x.kind == "output")
        for t in head:  # output_norm, then the output matrix
            device = output_device(model, placement, self.where) if t.kind == "output" else self.where[t.name]
            current = self._step("output", current, device, t.kind, profile.compute_seconds(t), activation)
        if model.tied_embeddings:
            t = next(x for x in model.tensors if x.kind == "token_embd")
            current = self._step("output", current, output_device(model, placement, self.where), "output",
                                 t.n_bytes * profile.seconds_per_byte(t.type), activation)
        self._step("output", current, HOST, "sampling", 0.0, model.n_vocab * 4)  # the logits come back

    def _step(self, stage: str, current: int, device: int, kind: str, seconds: float, n_bytes: int) -> int:
        """One operator on device after the graph was on current; returns the device the graph is on now."""
        if device != current:
            for d in (current, device):  # leaving a device and coming to one: each pays half its visit
                if d != HOST:
                    link = self.devices[d]
                    cost = link.visit_s / 2 + n_bytes / link.bandwidth
                    self.transfer_s += cost
                    self.by_stage[stage] = self.by_stage.get(stage, 0.0) + cost
            self.transfer_bytes += n_bytes
            if device != HOST:
                self.visits += 1
        if device == HOST:
            self.host += seconds
        else:
            d = self.devices[device]
            on_device = seconds * d.ratio(kind) + (d.launch_s if seconds else 0.0)
            self.compute[device] += on_device
            self.by_stage[stage] = self.by_stage.get(stage, 0.0) + on_device - seconds
        return device


def _owner(name: str) -> str:
    """The operator a norm or bias belongs to: blk.3.attn_q.bias -> attn_q, blk.3.ffn_norm.weight -> ffn_norm."""
    return name.split(".")[2]


def predict(model: Model, placement: Placement, devices: list[DeviceProfile], profile: Profile,
            resident: Collection[str], window: int, io_threads: int) -> Cost:
    """Seconds per decoded token: the host pipeline (its streaming and compute, costmodel.simulate) with every
    operator on a device computing there instead, and the visits' costs, in the stages where they happen.
    `resident` is the host's resident set; tensors on a device count as resident (the host never reads them)."""
    walk = Walk(model, placement, devices, profile)
    on_devices = {n for n, d in walk.where.items() if d != HOST}
    stages = Pipeline(model, profile, io_threads).stages(set(resident) | on_devices)
    names = [s.name for s in stages]
    extra = [0.0] * len(stages)
    for stage, seconds in walk.by_stage.items():
        if stage in names:
            extra[names.index(stage)] += seconds
        elif stage == "output":  # a resident head is part of the last block's stage
            extra[-1] += seconds
        else:
            extra[0] += seconds
    stages = [replace(s, compute_s=s.compute_s + x) for s, x in zip(stages, extra)]
    return Cost(simulate(stages, window).seconds_per_token, tuple(walk.compute), walk.host, walk.visits,
                walk.transfer_s, walk.transfer_bytes)


def device_bytes(model: Model, placement: Placement, kv_cache: int, compute: int) -> list[int]:
    """Memory each device needs: its weights (a tied token_embd's copy where the output head is), and the larger of
    what loading them takes beside them (an RPC server receives each piece whole before it copies it into place:
    load_piece) and what running takes (its blocks' share of the KV cache and a compute buffer as large as the
    host's, an upper bound: it holds its splits' tensors). The load ends before the context is made."""
    where = tensor_devices(model, placement)
    used = [0] * len(placement.devices)
    for t in model.tensors:
        if where[t.name] != HOST:
            used[where[t.name]] += t.n_bytes
    if model.tied_embeddings:
        head = output_device(model, placement, where)
        if head != HOST:
            used[head] += next(t.n_bytes for t in model.tensors if t.kind == "token_embd")
    running = [0] * len(placement.devices)
    for d in kv_devices(model, placement):
        if d != HOST:
            running[d] += kv_cache // max(model.n_layer, 1)
    piece = load_piece(model, placement)
    return [u + max(piece, run + compute) if u else 0 for u, run in zip(used, running)]


def load_piece(model: Model, placement: Placement) -> int:
    """The largest piece a device's weights load in: llama.cpp reads a tensor bound for a device in pieces of at
    most LOAD_PIECE_BYTES (patch 0012; it read and sent it whole before: 183 MiB for the 1.5B's output matrix)."""
    where = tensor_devices(model, placement)
    sizes = [t.n_bytes for t in model.tensors if where[t.name] != HOST]
    if model.tied_embeddings and output_device(model, placement, where) != HOST:
        sizes += [t.n_bytes for t in model.tensors if t.kind == "token_embd"]
    return min(max(sizes, default=0), LOAD_PIECE_BYTES)


def load_bytes(model: Model, placement: Placement) -> int:
    """Host memory loading the devices' weights takes while it lasts: a piece read from the file, and the copy of
    it the RPC client serializes into its message (ggml-rpc.cpp, serialize_set_tensor)."""
    return 2 * load_piece(model, placement)


def host_view(model: Model, on_devices: Collection[str]) -> Model:
    """The model as this machine holds it: a tensor on a device weighs nothing here (the host planners keep it
    "resident" at no cost, and the pipeline gives it no host compute: the device's is added by predict)."""
    on_devices = set(on_devices)
    return replace(model, tensors=[replace(t, n_bytes=0) if t.name in on_devices else t for t in model.tensors])


def to_plan(model: Model, placement: Placement, host: Plan, cost: Cost, device_memory: list[int],
            device_budgets: Mapping[str, int]) -> Plan:
    """The host's streaming plan with the placement's tensors on their devices (placed), its prediction replaced
    by the placement's."""
    # the placement's overrides, as tensors.ot lines (what the layer assignment places needs none); a tensor kept
    # home that the host streams needs none either: its STREAMED line comes first, and is on the host
    streamed = set(host.streamed)
    placed = tuple((n, b) for n, b in placement.placed if not (b == CPU_BUFT and n in streamed))
    devices = tuple(Share(name, device_budgets.get(name, 0), device_memory[i], cost.device_compute_s[i])
                    for i, name in enumerate(placement.devices))
    return replace(host, policy=f"{placement.policy}+{host.policy}", placed=placed,
                   predicted_tok_s=cost.tok_s, placement=Placed.of(placement, cost, devices))


def layers_on(model: Model, layers: Collection[int], buffer_type: str) -> Plan:
    """A plan keeping every weight resident, the weights of `layers` on the device whose buffer type llama.cpp names
    `buffer_type` (`RPC0[10.0.0.2:50052]`), tensor by tensor (tensors.ot): unlike -ngl, each layer's attention then
    computes on the host between the device's matrix multiplications (results/rpc_first_qwen1.5b.csv)."""
    names = tuple(t.name for t in model.tensors)
    placed = tuple((t.name, buffer_type) for t in model.tensors if t.layer in layers)
    on_host = sum(t.n_bytes for t in model.tensors if t.layer not in layers)
    return Plan(model=str(model.path), policy="layers-on", budget=0,
                memory=Memory(resident=on_host, window=0, kv_cache=0, compute=0, overhead=0),
                resident=names, streamed=(), window=0, io_threads=1, predicted_tok_s=0.0, roofline_tok_s=0.0,
                placed=placed)


def on_devices(plan: Plan, model: Model) -> set[str]:
    """The tensors a plan puts on other devices, by override or by llama.cpp's layer assignment."""
    if plan.placement is None:
        return {n for n, b in plan.placed if b != CPU_BUFT}
    where = tensor_devices(model, plan.placement)
    return {n for n, d in where.items() if d != HOST}


def check_fits(plan: Plan, model: Model, budget: int | None, directory, of: str = "") -> None:
    """Refuse a saved plan made for another model (its tensors or their sizes differ) or larger than the budget
    (of: what the budget was given as, for the message)."""
    sizes = {t.name: t.n_bytes for t in model.tensors}
    # an mmap plan (plan --tune measured mmap fastest) holds no weights of its own: its resident bytes are 0; the
    # bytes of tensors placed on another device are that device's, not this machine's
    placed = on_devices(plan, model)
    resident = 0 if plan.policy == "mmap" else sum(sizes.get(n, 0) for n in plan.resident if n not in placed)
    if set(plan.resident) | set(plan.streamed) != set(sizes) or resident != plan.memory.resident:
        raise FlexoffloadError(f"the plan in {directory} was made for another model ({Path(plan.model).name}), "
                               f"not {model.path.name}")
    if budget is not None and plan.memory.total > budget:
        raise FlexoffloadError(f"the plan in {directory} takes {format_size(plan.memory.total)}, more than the budget "
                               f"of {format_size(budget)}{of}")
