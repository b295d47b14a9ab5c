"""`flexoffload serve` through the API: prepared and planned as `run` is, then llama-server behind the front."""

from __future__ import annotations

from dataclasses import replace

from flexoffload import BudgetTooSmall
from flexoffload.runtime import server
from flexoffload.api.drafting import server_speculation
from flexoffload.api.running import enforceable, tell
from flexoffload.api.preparing import prepare


def speculation(p) -> server.Speculation | None:
    """llama-server's own speculation as prepare decided it for a server (drafting.for_server): the draft model
    (draft-simple) and the n-gram types, their lengths from the request; None where it serves without."""
    if not p.draft and not p.free:
        return None
    return server_speculation(p.draft, p.free, p.request)


def serve(request, n_parallel: int, listen, enforce: bool = False, extra: tuple[str, ...] = (), on_ready=None,
          tiled: bool = False):
    """`flexoffload serve`: llama-server for n_parallel sequences, prepared and planned as `run` is (the plan for that
    many sequences, the same settings, cgroup and page-cache handling; the speculation run would choose, as
    llama-server's own), behind the front (runtime/server.py: listen is its Listen), until SIGINT or SIGTERM.
    on_ready(port, load_s, prepared, enforced, n_parallel) once it answers (n_parallel: as capped, where the budget
    holds fewer sequences than asked); tiled: llama.cpp's tiled kernels instead of the row-by-row ones
    (server.environment); returns server.Served. options.request_for("serve", ...) makes a request with serve's own
    defaults (-c 4096, as the command line's)."""
    p, n_parallel = prepare_parallel(replace(request, prompt=request.prompt or " "), n_parallel)  # no prompt
    tell(p.notes)
    limit = p.limit if enforce and enforceable(p) else None
    ready = (lambda port, load_s: on_ready(port, load_s, p, limit is not None, n_parallel)) if on_ready else None
    return server.serve(str(p.model.path), p.settings, n_parallel, listen, limit, p.limit, extra,
                        lambda line: tell([line]), ready, speculation(p), tiled)


def prepare_parallel(request, n_parallel: int):
    """The server prepared for n_parallel sequences decoded together, or for as many as the budget holds where it
    does not hold them all (a pass holds the union of its sequences' experts, and each sequence its KV cells and
    logits row): (the Prepared, the sequences), the cap said in a note."""
    try:
        return prepare(request, n_seq_max=n_parallel, server=True), n_parallel
    except BudgetTooSmall as e:
        first = e
    low, high = 0, n_parallel  # the most that fit lies in [low, high)
    best = None
    while high - low > 1:
        n = (low + high) // 2
        try:
            best, low = prepare(request, n_seq_max=n, server=True), n
        except BudgetTooSmall:
            high = n
    if best is None:
        raise first
    capped = (f"flexoffload: -np capped at {low}: {n_parallel} sequences decoded together do not fit in --mem "
              f"{request.mem} ({first}); {low} do")
    return replace(best, notes=[*best.notes, capped]), low
