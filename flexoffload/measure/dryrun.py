"""llama.cpp's buffers for a context, asked of llama.cpp itself (a dry run), and what they make of a run's memory:
the smallest budget a setting works in, and the longest prompt a budget holds (HyperGen, issue 16).

A child loads the model with no_alloc (metadata only, nothing read) and makes one context per setting, reading the
sizes it logs (as the footprint probe does); one child answers many settings, and the answers are cached.
memory/stepmem.py says what the sizes are and adds the CPU work buffer from the graph's shapes.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, file_key, write_atomic
from flexoffload.gguf.model import Model
from flexoffload.measure.probe import child_json, measure
from flexoffload.memory.budgets import MiB, format_size
from flexoffload.memory.footprint import slack, smallest_budget
from flexoffload.memory.stepmem import CELLS, UBATCHES, Buffers, Setting, cells_for, work_bytes
from flexoffload.plan.planners import minimum_budget

_KV = re.compile(r"llama_kv_cache: size =\s*([0-9.]+) MiB")
_COMPUTE = re.compile(r"compute buffer size =\s*([0-9.]+) MiB")
_OUTPUT = re.compile(r"output buffer size =\s*([0-9.]+) MiB")

log = logging.getLogger(__name__)


def _cache_path(model: Model) -> Path:
    return cache_dir() / "footprints" / f"{file_key(model.path)}-buffers-v1.json"


def buffers(model: Model, settings: list[Setting]) -> list[Buffers]:
    """llama.cpp's buffers for each setting (cached per model file; those not cached asked of one child)."""
    path = _cache_path(model)
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    missing = [s for s in settings if s.key() not in known]
    if missing:
        cmd = [sys.executable, "-m", "flexoffload.measure.dryrun", str(model.path),
               json.dumps([asdict(s) for s in missing])]
        known.update(child_json(cmd, f"llama.cpp's dry run of {model.path.name}", 600))
        write_atomic(path, json.dumps(known))
    out = []
    for s in settings:
        sizes = known[s.key()]
        fa = sizes.pop("flash_attn", s.flash_attn == "on")
        out.append(Buffers(**sizes, work=work_bytes(model, min(s.n_ubatch, s.n_ctx), s.n_ctx, fa)))
    return out


def dry_run(model_path: str, settings: list[Setting]) -> dict[str, dict]:
    """In this process: the model's metadata only (no_alloc: no tensor is read or allocated), a context per setting,
    the sizes llama.cpp logs for it (flash_attn: whether it ran with flash attention, "auto" resolved)."""
    from flexoffload.runtime import engine

    lib = engine.llama_cpp()
    log = engine._Log(lib, verbose=False, keep=None)
    mparams = lib.llama_model_default_params()
    mparams.no_alloc = True
    mparams.load_mode = lib.LLAMA_LOAD_MODE_NONE
    mparams.use_extra_bufts = False
    model = lib.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise FlexoffloadError(f"llama.cpp could not read {model_path}")
    n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
    out = {}
    try:
        for s in settings:
            log.lines.clear()
            cparams = engine.context_params(lib, engine.Settings(
                n_ctx=s.n_ctx, n_batch=s.n_ubatch, n_ubatch=s.n_ubatch, n_threads=1, flash_attn=s.flash_attn,
                type_k=s.type_k, type_v=s.type_v, n_outputs=s.n_outputs))
            ctx = lib.llama_init_from_model(model, cparams)
            if not ctx:
                raise FlexoffloadError(f"llama.cpp refused a context of {s.n_ctx} cells, ubatch {s.n_ubatch}, "
                                       f"flash attention {s.flash_attn}, KV {s.type_k}/{s.type_v}")
            found = {name: [float(m.group(1)) for line in log.lines for m in [p.search(line)] if m]
                     for name, p in (("kv_cache", _KV), ("compute", _COMPUTE), ("output", _OUTPUT))}
            if not found["compute"]:
                raise FlexoffloadError(f"llama.cpp did not report its compute buffer size for {model_path}")
            sizes = {k: int(sum(v + 0.005 for v in found[k]) * MiB) for k in found}
            sizes["output"] = max(sizes["output"], 4 * n_vocab * s.n_outputs)
            # "auto" is resolved as the context is made, and logged ("Flash Attention enabled")
            sizes["flash_attn"] = s.flash_attn == "on" or (
                s.flash_attn == "auto" and any("Flash Attention enabled" in line for line in log.lines))
            out[s.key()] = sizes
            lib.llama_free(ctx)
    finally:
        lib.llama_model_free(model)
    return out


def main() -> None:
    model_path, settings = sys.argv[1], [Setting(**d) for d in json.loads(sys.argv[2])]
    try:
        print(json.dumps(dry_run(model_path, settings)))
    except FlexoffloadError as e:
        print(f"flexoffload: {e}", file=sys.stderr)
        sys.exit(1)


def room(model: Model, setting: Setting) -> int:
    """The memory the compute buffers give back when decode starts: the prefill's ubatch against DECODE_UBATCH's
    (0 where the prefill's ubatch is no wider)."""
    from dataclasses import replace

    from flexoffload.plan.prefill import DECODE_UBATCH

    if setting.n_ubatch <= DECODE_UBATCH:
        return 0
    wide, narrow = buffers(model, [setting, replace(setting, n_ubatch=DECODE_UBATCH)])
    return wide.compute - narrow.compute


def run_costs(model: Model, setting: Setting, budget: int = 0) -> dict[str, int]:
    """make_plan's costs beside the weights at a setting: the KV cache, the buffers a pass computes in (compute,
    output and the work buffer), the overhead (the heap, sampling, the runtime, the budget's slack: footprint's
    probe at a small context, as those do not grow with it) and the code."""
    b = buffers(model, [setting])[0]
    base = measure(model, CELLS * 2, 64)
    return dict(kv_cache=b.kv_cache, compute=b.compute + b.output + b.work,
                overhead=base.heap + base.sampling + base.runtime + slack(budget), code=base.code)


def minimum(model: Model, setting: Setting, costs: dict[str, int] | None = None) -> int:
    """The smallest budget a run at this setting works in: everything streamable streamed, window 0."""
    return smallest_budget(minimum_budget(model, 0, **(costs or run_costs(model, setting))))


@dataclass(frozen=True)
class Longest:
    """The longest prompt a budget holds, the ubatch it needs, and what that takes."""

    n_prompt: int
    n_ubatch: int
    minimum: int  # the budget the run needs at that length and ubatch
    kv_cache: int
    compute: int


def _knots(model: Model) -> list[int]:
    """Contexts the sweep asks llama.cpp about; between them sizes are interpolated (the KV cache grows by the
    same bytes a cell; the compute buffer by the mask's row a cell, once the largest tensor is the scores')."""
    top = cells_for(model.n_ctx_train)
    return sorted({CELLS, 2 * CELLS, 4 * CELLS, top // 8, top // 4, top // 2, top} - {0})


def _interpolate(xs: list[int], ys: list[int], x: int) -> int:
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return int(y0 + (y1 - y0) * (x - x0) / (x1 - x0)) + 1
    return ys[-1]


def max_prompt(model: Model, budget: int, n_predict: int = 0, flash_attn: str = "on", type_k: str = "f16",
               type_v: str = "f16") -> Longest | None:
    """The longest prompt (to the cache's CELLS) whose run fits the budget with some ubatch of UBATCHES, up to the
    model's trained context, and the largest ubatch it fits with (fewer passes over the streamed weights). None if
    not even the shortest fits. One dry run answers a sweep of contexts for every ubatch (_knots), the search
    interpolates between them, and the answer is asked of llama.cpp itself (stepping to the last length that fits)."""
    knots = _knots(model)
    log.info("finding the longest prompt %s holds in %s: llama.cpp's buffers for %d contexts at each of %d ubatches "
             "(dry runs: nothing is read; cached), a few seconds to a minute", model.path.name, format_size(budget),
             len(knots), len(UBATCHES))
    sweep = {u: buffers(model, [Setting(c, min(u, c), flash_attn, type_k, type_v) for c in knots])
             for u in UBATCHES}
    base = measure(model, CELLS * 2, 64)
    fixed = dict(overhead=base.heap + base.sampling + base.runtime + slack(budget), code=base.code)

    def costs(n_ctx: int, u: int, exact: bool) -> dict[str, int]:
        if exact:
            b = buffers(model, [Setting(n_ctx, min(u, n_ctx), flash_attn, type_k, type_v)])[0]
            kv, compute = b.kv_cache, b.compute + b.output + b.work
        else:
            kv = _interpolate(knots, [b.kv_cache for b in sweep[u]], n_ctx)
            compute = _interpolate(knots, [b.compute + b.output + b.work for b in sweep[u]], n_ctx)
        return dict(kv_cache=kv, compute=compute, **fixed)

    def fitting(n_ctx: int, exact: bool = False) -> tuple[int, dict] | None:
        for u in sorted(UBATCHES, reverse=True):
            c = costs(n_ctx, u, exact)
            if minimum(model, Setting(n_ctx, u), c) <= budget:
                return u, c
        return None

    top = cells_for(model.n_ctx_train) // CELLS
    if fitting(CELLS, exact=True) is None:
        return None
    lo, hi = 1, top  # lo fits (in cells of CELLS), anything above hi does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fitting(mid * CELLS) is not None:
            lo = mid
        else:
            hi = mid - 1
    while lo > 1 and fitting(lo * CELLS, exact=True) is None:
        lo -= 1
    while lo < top and fitting((lo + 1) * CELLS, exact=True) is not None:
        lo += 1
    n_ctx = lo * CELLS
    u, c = fitting(n_ctx, exact=True)
    return Longest(n_prompt=max(min(n_ctx, model.n_ctx_train) - n_predict, 0), n_ubatch=min(u, n_ctx),
                   minimum=minimum(model, Setting(n_ctx, u), c), kv_cache=c["kv_cache"], compute=c["compute"])


if __name__ == "__main__":
    main()
