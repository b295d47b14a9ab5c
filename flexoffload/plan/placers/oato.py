"""OATO's Algorithm 1 (the scheduler and placer), as the paper writes it, on llama.cpp's devices.

Every weight-bearing operator (a matrix multiplication: its weight, with its bias) has a device affinity
B = (Tc - Tg) / M: the time it saves on the device per byte of device memory it takes. The transfer correction
takes off T', the cost of moving its input there and its output back: B' = (Tc - Tg - T') / M. Operators are
placed in descending B' while the device's memory stays under 90 % of its capacity (the cap leaves room for
the framework's buffers; what the device holds counts its load and compute buffers too: placement.device_bytes). Times are the cost model's: Tc the host profile's, Tg the device profile's (its
compute ratio and launch), T' its link's (a visit and the activations' bytes; the logits for the output matrix).

As written, the order is followed whatever B' is: on a device no faster than the host (an RPC server on the same
kind of CPU) every B' is negative, and the largest operators, whose transfer costs least per byte, go first.
Each block's attention stays where its KV cache is, on the host (n_gpu_layers 0; the paper's placement is per
operator). With more than one device, the first is filled before the next (the paper has one GPU).
"""

from __future__ import annotations

from flexoffload.defaults import LOAD_PIECE_BYTES
from flexoffload.plan.costmodel import MATMUL_KINDS
from flexoffload.plan.placement import DeviceProfile, Placement
from flexoffload.plan.placers.common import Problem

CAP = 0.9  # of a device's memory


def affinity(problem: Problem, device: DeviceProfile, weight, n_bytes: int) -> float:
    tc = problem.profile.compute_seconds(weight)
    tg = tc * device.ratio(weight.kind) + device.launch_s
    out = problem.model.n_vocab * 4 if weight.kind == "output" else problem.model.n_embd * 4
    transfer = device.visit_s + (problem.model.n_embd * 4 + out) / device.bandwidth
    return (tc - tg - transfer) / n_bytes


def place(problem: Problem) -> Placement:
    model = problem.model
    biases = {t.name.removesuffix(".bias") + ".weight": t for t in model.tensors if t.kind == "bias"}
    operators = [(t, [t] + ([biases[t.name]] if t.name in biases else [])) for t in model.tensors
                 if t.kind in MATMUL_KINDS]
    placed: list[tuple[str, str]] = []
    chosen = set()
    for d, device in enumerate(problem.devices):
        used, largest = 0, 0  # weights; beside them the larger of the load's piece and the compute buffer
        ranked = sorted(operators, key=lambda op: -affinity(problem, device, op[0], sum(x.n_bytes for x in op[1])))
        for weight, tensors in ranked:
            n_bytes = sum(x.n_bytes for x in tensors)
            big = max(largest, min(weight.n_bytes, LOAD_PIECE_BYTES))
            if weight.name in chosen or used + n_bytes + max(big, problem.compute) > CAP * problem.budgets[d]:
                continue
            used, largest = used + n_bytes, big
            chosen.add(weight.name)
            placed += [(x.name, device.name) for x in tensors]
    order = {t.name: i for i, t in enumerate(model.tensors)}
    return Placement("oato", problem.names, 0, (), tuple(sorted(placed, key=lambda p: order[p[0]])))
