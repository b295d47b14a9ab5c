"""What a run takes beside its weights: the sizes llama.cpp reports for a context and the process's own counters
(measured by measure/probe.py's probe), and the slack a budget keeps beside them.

A run's memory beside the weights depends on the architecture in ways no formula over a few header fields gets
right (sliding-window layers, K and V for only some layers, per-architecture graphs, the vocabulary's heap), so it is
measured, once per model file and setting, and passed to the planners as a Footprint.
"""

from __future__ import annotations

from dataclasses import dataclass

# Beside what the probe measures, a budget keeps the kernel memory a run is charged for (page tables, thread
# stacks, slab: a page-table page per 2 MiB mapped, 512 entries of 8 bytes, and a fixed part for threads and files,
# about 2 MiB in the matrix's runs) and a margin for what no counter predicts (malloc's arenas and fragmentation).
KERNEL_FIXED = 2 << 20  # 2 MiB (MiB is budgets.py's, which imports this module)
KERNEL_PER_BYTE = 1 / 512
MARGIN = 0.01


@dataclass(frozen=True)
class Footprint:
    """Bytes a run takes beside the weights: a context as llama.cpp allocated it for one model and setting, the
    heap loading them added, and the process's own runtime and code."""
    kv_cache: int  # K and V of every layer that keeps them (sliding-window layers: their window's cells)
    compute: int  # the compute buffer, reserved for a ubatch of n_batch tokens
    output: int  # logits (and embeddings) of n_outputs rows
    heap: int  # the model's and context's heap: token texts, the token map, merges, tensor metadata, bookkeeping
    sampling: int  # a sampled token's scratch: llama.cpp's candidate array (12 bytes per token) and a logits copy
    runtime: int  # the process's anonymous memory before llama.cpp loads: Python, flexoffload, libllama, the header
    code: int  # the file pages the process maps, the model's excepted: its code, reclaimable but in use

    @property
    def total(self) -> int:
        """What a model's context and heap take (a second model in the same process takes this again)."""
        return self.kv_cache + self.compute + self.output + self.heap + self.sampling


def slack(budget: int) -> int:
    """Kernel memory and margin a run within budget bytes keeps room for."""
    return KERNEL_FIXED + int(budget * (KERNEL_PER_BYTE + MARGIN))


def smallest_budget(need: int) -> int:
    """The smallest budget B that holds need bytes (KERNEL_FIXED counted in them) and the rest of its own slack."""
    return int(need / (1 - KERNEL_PER_BYTE - MARGIN)) + 1


def costs(run: Footprint, draft: int = 0, budget: int = 0) -> dict[str, int]:
    """A run's memory beside weights and window, as make_plan takes it: kv_cache, compute, overhead (heap,
    runtime, draft, and the slack a budget of this size keeps), code."""
    return dict(kv_cache=run.kv_cache, compute=run.compute + run.output,
                overhead=run.heap + run.sampling + run.runtime + draft + slack(budget), code=run.code)
