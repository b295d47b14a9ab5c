"""A real run's passes replayed on another target (Options.replay; scripts/spec_replay): each pass's draft steps,
the target's verification of as many rows, and as many tokens kept as the real run kept. What the pair's speculation
would cost where the target is one the draft was never measured with: a synthetic 7B, say, whose random weights
would accept nothing of a real draft's.

Not lossless and not for users: the tokens kept are the trace's counts, not the target's choices. Everything else is
a speculating pass's real work: the draft's one-token decodes (with their softmax over the vocabulary), the target's
pass over a chain of rows on the per-row kernels a tree uses, its argmax over each kept row, the KV cells of the rows
it did not keep dropped in both caches. A chain costs what a tree of as many rows does (the rows' compute; its mask is
the causal one). The draft steps are decoded before the pass, as a measured run drafts (no pipeline).
"""

from __future__ import annotations

import time

import numpy as np

from flexoffload import FlexoffloadError, native
from flexoffload.runtime.results import Result, TextOut, stream_timings
from flexoffload.speculation.state import _Batch, _Call
from flexoffload.speculation.tree import Stats


def check(trace) -> tuple[tuple[int, int, int], ...]:
    """The trace as (rows, kept, steps) a pass: rows verified (the root counted), tokens kept (the target's own
    counted: 1 to rows), draft steps. ValueError where it is not one."""
    out = []
    for p in trace:
        rows, kept, steps = (int(x) for x in p[:3])
        if not 1 <= kept <= rows or steps < 0:
            raise ValueError(f"a pass of {rows} rows keeping {kept} tokens after {steps} draft steps")
        out.append((rows, kept, steps))
    if not out:
        raise ValueError("an empty trace")
    return tuple(out)


def replayed(spec, prompt_tokens: list[int], trace, n_predict: int, on_text=None) -> Result:
    """The trace's passes on spec's models (a Speculator, both caches just emptied), after the prompt: as many as
    fit n_predict tokens (-1: all) and the context. Its timings: a speculating run's, passes included."""
    lib, t, d = spec.lib, spec.target, spec.draft
    rows_max = spec.n_nodes_max
    c = _Call(tbatch=_Batch(lib, max(t.n_batch, rows_max), 1), dbatch=_Batch(lib, d.n_batch, 1) if d else None,
              sampler=None, pos_limit=spec.n_ctx - 1, alpha=0.0, threshold=0.0)
    stats: Stats = c.stats
    tmem = lib.llama_get_memory(t.ctx)
    dmem = lib.llama_get_memory(d.ctx) if d else None
    text_out, stop = TextOut(t, on_text), "limit"

    def argmax(i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(lib.llama_get_logits_ith(t.ctx, i), shape=(spec.n_vocab,))))

    try:
        t_start = time.perf_counter()
        if d and len(prompt_tokens) > 1:
            spec.grower.draft_decode(c, prompt_tokens[:-1], 0, 0)
        for i in range(0, len(prompt_tokens), t.n_batch):
            t._decode(prompt_tokens[i:i + t.n_batch])
        token = argmax(-1)
        t_first = time.perf_counter()
        text_out.emit(token)
        pos = len(prompt_tokens)  # the root's: the last token out, not yet in the target's cache
        dpos = len(prompt_tokens) - 1  # the draft's next cell
        for rows, kept, steps in trace:
            if n_predict >= 0 and len(text_out.tokens) >= n_predict:
                break
            rows = min(rows, rows_max)
            kept = min(kept, rows)
            if pos + rows >= c.pos_limit:
                stop = "context"
                break
            t0 = time.perf_counter()
            for _ in range(steps if d else 0):  # the draft's steps: a token each, down the chain
                spec.grower.draft_decode(c, [token], dpos, 0)
                dpos += 1
            t1 = time.perf_counter()
            c.tbatch.fill([(token, pos + j, [0], True) for j in range(rows)])
            native.set_tiled_matmul(0)  # a tree's kernels (verify.py)
            try:
                rc = lib.llama_decode(t.ctx, c.tbatch.batch)
            finally:
                native.set_tiled_matmul(-1)
            if rc != 0:
                raise FlexoffloadError(f"the target's llama_decode failed ({rc}): {t.log.last_error()}")
            t2 = time.perf_counter()
            out = [argmax(j) for j in range(kept)]  # the walk's samples down the kept rows
            lib.llama_memory_seq_rm(tmem, 0, pos + kept, -1)
            pos += kept
            if d and dpos > pos - 1:  # the draft keeps its cells up to the new root
                lib.llama_memory_seq_rm(dmem, 0, pos - 1, -1)
                dpos = pos - 1
            token = out[-1]
            for x in out:
                if n_predict >= 0 and len(text_out.tokens) >= n_predict:
                    break
                text_out.emit(x)
            t3 = time.perf_counter()
            stats.n_verify += 1
            stats.tree_sizes.append(rows)
            stats.n_drafted += rows - 1
            stats.n_accepted += kept - 1
            stats.n_emitted += kept
            stats.draft_s += t1 - t0
            stats.target_s += t2 - t1
            stats.passes.append([rows, kept, steps, t1 - t0, t2 - t1, t3 - t2])
        t_end = time.perf_counter()
    finally:
        c.tbatch.free()
        if c.dbatch:
            c.dbatch.free()
    timings = stats.to_dict(len(text_out.tokens))
    timings["replayed"] = len(stats.passes)
    if t.settings.strategy != "mmap":
        timings.update(stream_timings(t_end - t_start, t.model))
    return Result.of(prompt_tokens, text_out, (t_start, t_first, t_end), len(text_out.tokens) - 1,
                     t.load_s + (d.load_s if d else 0.0), t.settings.strategy + "+replay", stop, timings)
