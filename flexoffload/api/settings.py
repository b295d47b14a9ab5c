"""The one translation of what prepare decided into the runtime's Settings: what `run` loads by (engine.Engine sets
them through the C API) and what `serve` hands llama-server (runtime/server.py turns the same Settings into flags
and its environment)."""

from __future__ import annotations

from flexoffload.defaults import IO_THREADS
from flexoffload.measure import dryrun, profiler
from flexoffload.native import devices
from flexoffload.plan import plans, prefill
from flexoffload.runtime import engine
from flexoffload.api.planning import step_setting


def settings_for(w, plan, limit: int | None, model, tree: bool) -> tuple[engine.Settings, float]:
    """The runtime's settings for the values decided (w: the request with prepare's decisions in it) and the plan;
    and decode's predicted speed where weights move in after the prompt (0: the plan's)."""
    pairs = plans.overrides(plan) if plan else []  # tensors.ot's lines: (pattern, buffer type)
    after, decode_tok_s, decode_ubatch = (), 0.0, 0
    setting = step_setting(w)
    if setting is not None and not w.rpc and w.move_back and not tree:
        # decode after the prompt: the compute buffers shrink, and what they give back holds weights
        decode_ubatch = prefill.DECODE_UBATCH
        if plan is not None and limit is not None and w.strategy == "stream" and not w.plan_dir:
            after, decode_tok_s = prefill.after_prefill(model, plan, dryrun.room(model, setting),
                                                        profiler.measure(model, w.n_threads))
    settings = engine.Settings(
        n_ctx=w.n_ctx, n_batch=w.n_batch, n_threads=w.n_threads, temp=w.temp, seed=w.seed & 0xFFFFFFFF,
        strategy=w.strategy,
        streamed_patterns=tuple(p for p, b in pairs if b == plans.STREAMED_BUFT),
        placed_patterns=tuple((p, b) for p, b in pairs if b != plans.STREAMED_BUFT),
        rpc=tuple(devices.parse_endpoints(w.rpc)) if w.rpc else (),
        n_ubatch=w.n_ubatch, flash_attn=w.flash_attn, type_k=w.cache_type_k, type_v=w.cache_type_v,
        decode_ubatch=decode_ubatch, resident_after_prefill=tuple(after),
        n_gpu_layers=plan.placement.n_gpu_layers if plan and plan.placement else w.n_gpu_layers,
        tensor_split=plan.placement.tensor_split if plan and plan.placement else (),
        window=(w.window if w.window is not None else plan.window) if plan else 0,
        expert_slots=plan.experts.slots if plan and plan.experts else -1,
        expert_policy=plan.experts.policy if plan and plan.experts else "lru",
        expert_whole=bool(plan and plan.experts and plan.experts.whole),
        expert_ahead=bool(plan and plan.experts and plan.experts.ahead),
        expert_lookahead=bool(plan and plan.experts and plan.experts.lookahead),
        io_threads=w.io_threads or (plan.io_threads if plan else IO_THREADS), verbose=w.verbose)
    return settings, decode_tok_s
