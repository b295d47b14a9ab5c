"""Placements of weights across devices (issue 15; the solver policies are still to come).

`layers_on(model, layers, buffer_type)`: a plan keeping every weight resident, the weights of `layers` on the
device whose buffer type llama.cpp names `buffer_type` (`RPC0[10.0.0.2:50052]`), tensor by tensor (tensors.ot).
Unlike `-ngl`, which moves whole layers with their KV cache, each layer's attention then computes on the host
between the device's matrix multiplications: more graph splits, each a round trip (results/rpc_first_qwen1.5b.csv).
"""

from __future__ import annotations

from collections.abc import Collection

from .model import Model
from .plan import Memory, Plan


def layers_on(model: Model, layers: Collection[int], buffer_type: str) -> Plan:
    names = tuple(t.name for t in model.tensors)
    placed = tuple((t.name, buffer_type) for t in model.tensors if t.layer in layers)
    on_host = sum(t.n_bytes for t in model.tensors if t.layer not in layers)
    return Plan(model=str(model.path), policy="layers-on", budget=0,
                memory=Memory(resident=on_host, window=0, kv_cache=0, compute=0, overhead=0),
                resident=names, streamed=(), window=0, io_threads=1, predicted_tok_s=0.0, roofline_tok_s=0.0,
                placed=placed)
