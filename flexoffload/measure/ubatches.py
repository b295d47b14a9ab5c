"""The prefill's measured side (HyperGen, issue 16): how fast a ubatch's pass computes here (`rates`), and llama.cpp's
own buffers at each ubatch a long prompt may be computed in (`candidates`). plan/prefill.py predicts from them and
chooses the ubatch (`choose_ubatch`).
"""

from __future__ import annotations

import json
import logging
import time

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, file_key
from flexoffload.gguf.model import Model
from flexoffload.measure import Progress
from flexoffload.measure.dryrun import minimum, room, run_costs
from flexoffload.memory.stepmem import UBATCHES, Setting
from flexoffload.plan.prefill import Ubatch, ubatches_for

log = logging.getLogger(__name__)


def rates(model: Model, n_threads: int, remeasure: bool = False, up_to: int | None = None) -> dict[int, float]:
    """Seconds one prefill pass of u tokens takes with every weight in memory, by u (UBATCHES), cached: a context
    of the largest ubatch timed, warm, the best of two passes at each size. up_to: only the sizes up to the least
    ubatch that holds up_to tokens are needed (those missing from the cache timed and added to it); None: all.
    A large model's first use then times the passes its prompt can take, not 2048-token ones (a 17 GB MoE: about
    a quarter of the tokens for a 512-token prompt). A file over half the memory is timed on two slices of its
    first layers, scaled by a layer's share of a pass (_sliced): in memory whole it would thrash."""
    from flexoffload.measure.profiler import too_large

    path = cache_dir() / "profiles" / f"{file_key(model.path)}-t{n_threads}-prefill-v1.json"
    known = {} if remeasure or not path.exists() else {int(k): v for k, v in json.loads(path.read_text()).items()}
    top = max(UBATCHES) if up_to is None else min((u for u in UBATCHES if u >= up_to), default=max(UBATCHES))
    missing = [u for u in UBATCHES if u <= top and u not in known]
    if not missing:
        return known
    sliced = too_large(model.file_size)
    log.info("timing a prefill pass of %s at each ubatch, %d to %d tokens (once, cached): %s, then %d prefill "
             "tokens%s; it says how long to go as it goes", model.path.name, min(missing), max(missing),
             "two slices of its first layers written beside it, each read into the page cache" if sliced else
             f"the file read into the page cache first ({model.file_size / 1e9:.1f} GB)",
             2 * sum(missing), " on each" if sliced else "")
    out = dict(known)
    out.update(_sliced(model, missing, n_threads) if sliced else _timed(model.path, missing, n_threads))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({str(u): out[u] for u in sorted(out)}))
    return out


def _timed(path, sizes: list[int], n_threads: int) -> dict[int, float]:
    """A pass of each of sizes tokens with the file at path in memory: the best of two, warm."""
    from flexoffload.measure.profiler import warm_page_cache
    from flexoffload.runtime import engine

    warm_page_cache(path)
    progress = Progress(log, "prefill timing", 2 * sum(sizes), "tokens")
    settings = engine.Settings(n_ctx=max(sizes) + 64, n_batch=max(sizes), n_ubatch=max(sizes),
                               n_threads=n_threads, temp=0.0, flash_attn="on")
    out, done = {}, 0
    with engine.Engine(str(path), settings) as eng:
        lib = eng.lib
        n_vocab = lib.llama_vocab_n_tokens(eng.vocab)
        for u in sizes:
            tokens = [(7 * i + 11) % n_vocab for i in range(u)]
            best = None
            for _ in range(2):
                lib.llama_memory_clear(lib.llama_get_memory(eng.ctx), True)
                t0 = time.perf_counter()
                eng._decode(tokens)
                seconds = time.perf_counter() - t0
                best = seconds if best is None else min(best, seconds)
                done += u
                progress(done)
            out[u] = best
    return out


def _sliced(model: Model, sizes: list[int], n_threads: int) -> dict[int, float]:
    """_timed for a model too large to hold: each size timed on two slices of its first layers
    (profiler.on_two_slices). A layer's share of the deeper slice's pass is their slope at the largest size (a pass
    of seconds a layer: a short pass's slope is mostly noise), taken as the same at every size; the rest of the
    layers are added at it to each size's pass on the deeper slice (which says how a batch's size pays)."""
    from flexoffload.measure.profiler import on_two_slices

    (shallow, low), (deep, high) = on_two_slices(model, lambda part: _timed(part, sizes, n_threads))
    top = max(sizes)
    share = max(high[top] - low[top], 0.0) / (deep - shallow) / high[top]  # a layer's, of the deeper slice's pass
    return {u: high[u] * (1 + share * (model.n_layer - deep)) for u in sizes}


def candidates(model: Model, budget: int, n_prompt: int, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
               n_outputs: int = 1) -> list[Ubatch]:
    """The ubatches a prompt of n_prompt tokens may be computed in (plan/prefill.ubatches_for), each with llama.cpp's
    buffers at it (flash attention on, as a chosen ubatch runs)."""
    out = []
    for u in ubatches_for(n_prompt):
        setting = Setting(n_ctx, min(u, n_ctx), "on", type_k, type_v, n_outputs=n_outputs)
        out.append(Ubatch(setting.n_ubatch, run_costs(model, setting, budget), room(model, setting)))
    return out


def none_fits(model: Model, budget: int, n_ctx: int, type_k: str = "f16", type_v: str = "f16",
              n_outputs: int = 1) -> FlexoffloadError:
    """The error where no ubatch's buffers fit beside the smallest plan: what the context needs at the least."""
    from flexoffload.memory.budgets import format_size

    least = minimum(model, Setting(n_ctx, min(min(UBATCHES), n_ctx), "on", type_k, type_v, n_outputs=n_outputs))
    return FlexoffloadError(f"a context of {n_ctx} cells does not fit {model.path.name} in {format_size(budget)} at "
                            f"any ubatch: it needs {format_size(least, up=True)} (plan --max-prompt: the longest "
                            f"prompt this budget holds)")
