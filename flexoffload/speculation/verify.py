"""The target's pass over a token tree (Verifier): one llama_decode over every node, each attending to its
ancestors, then the walk down what the target's own sampler picks at each node; what the drafters are told of it and
how the draft's thresholds adapt. While the pass waits on the disk, the draft may go on along the most confident
branch (the pipeline), on one thread the scheduler runs only when the target's threads sleep.

Bit-exact: the pass computes on the per-row kernels a one-token pass uses (set_tiled_matmul), so each node's logits
are those a run without speculation would have.

Apart from speculate.py because it is the target's side of a call alone: the drafting is grow.py's, the
caches' bookkeeping after the pass kvcache.py's.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from flexoffload import FlexoffloadError, native
from flexoffload.speculation import drafters as free
from flexoffload.speculation.kvcache import TreeCaches
from flexoffload.speculation.state import _Call
from flexoffload.speculation.tree import Node, Options, next_alpha, next_threshold
from flexoffload.speculation.grow import TreeGrower


class _ContextFull(Exception):
    """The target's cache has no cells left for a tree (Verifier.verify)."""


def _idle_thread() -> tuple[int, int] | None:
    """Put the calling thread under SCHED_IDLE; its policy and priority before, None where it cannot be changed."""
    try:
        before = os.sched_getscheduler(0), os.sched_getparam(0).sched_priority
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return before
    except (AttributeError, OSError):
        return None


def _restore_thread(before: tuple[int, int] | None) -> None:
    """Undo _idle_thread (a thread may leave SCHED_IDLE within its RLIMIT_NICE, which nice 0 always is)."""
    if before is not None:
        os.sched_setscheduler(0, before[0], os.sched_param(before[1]))


def _by_model(node: Node) -> bool:
    """Whether the draft model drafted the node (a free drafter may have proposed it too)."""
    return any(d is None for d, _ in node.origins)


class Verifier:
    """The target (an Engine, its context made for trees of up to n_nodes_max nodes) verifying the trees the grower
    drafts; the draft (None: free drafters alone) drafting on during its passes when the options pipeline."""

    def __init__(self, lib, target, draft, options: Options, drafters: list[free.Drafter], caches: TreeCaches,
                 grower: TreeGrower, n_nodes_max: int, n_vocab: int):
        self.lib, self.target, self.draft, self.options, self.drafters = lib, target, draft, options, drafters
        self.caches, self.grower, self.n_nodes_max, self.n_vocab = caches, grower, n_nodes_max, n_vocab
        # the pipeline: set once the target's pass is done; the draft's llama_decode then aborts (see _target_pass)
        self.target_done = False
        self.abort = self.lib.ggml_abort_callback(lambda data: self.target_done)

    def verify(self, c: _Call) -> tuple[list[int], bool]:
        """One target pass over the tree; the accepted tokens then the target's own, and whether generation ended.
        _ContextFull, and the tree dropped, where the target's cache has no cells left for it."""
        lib, t, tree = self.lib, self.target, c.tree
        nodes, seqs = tree.for_pass(self.n_nodes_max)
        self.caches.open_target(len(tree.branches))
        c.tbatch.fill([(n.token, n.pos, seqs[id(n)], True) for n in nodes])
        c.pass_nodes, c.pass_seqs = nodes, seqs
        c.stats.tree_sizes.append(len(nodes))
        c.stats.n_drafted += len(nodes) - 1

        from flexoffload.native import stream

        stall0 = stream.stats(t.model, layers=False).t_stall_s if t.settings.strategy != "mmap" else 0.0
        rc = []
        t0 = time.perf_counter()
        # the per-row kernels a one-token pass uses: with the tiled ones (from 8 tokens) the logits would differ in
        # their last bits from a run without speculation, and near ties would flip (patch 0009)
        native.set_tiled_matmul(-1 if self.options.tiled else 0)
        try:
            self._target_pass(c, rc)
        finally:
            native.set_tiled_matmul(-1)
        t_pass = time.perf_counter() - t0
        c.stats.target_s += t_pass
        if t.settings.strategy != "mmap":
            c.stats.stall_s += stream.stats(t.model, layers=False).t_stall_s - stall0
        if rc[0] == 1:  # no cells left for the tree (rejected ones hold some): nothing was decoded
            c.stats.tree_sizes.pop()
            c.stats.n_drafted -= len(nodes) - 1
            self.caches.drop_tree(c)
            raise _ContextFull
        if rc[0] != 0:
            raise FlexoffloadError(f"the target's llama_decode failed ({rc[0]}): {t.log.last_error()}")
        c.t_pass = t_pass if c.t_pass is None else 0.5 * (c.t_pass + t_pass)
        c.stats.n_verify += 1

        out, last, ended = tree.walk(nodes, lambda i: self._sample(c, i),
                                     lambda token: lib.llama_vocab_is_eog(t.vocab, token))
        accepted = len(out) - 1
        c.stats.n_accepted += accepted
        c.stats.n_emitted += len(out)
        self._judge(c, nodes, last)
        if c.control is not None:  # the draft's nodes whose parent the target accepted, by depth and rank
            kept = set(map(id, tree.path(last)))
            for n in nodes[1:]:
                rank = next((k for d, k in n.origins if d is None), None)
                if rank is not None and id(n.parent) in kept:
                    c.control.observe_node(n.pos - tree.root.pos, rank, id(n) in kept, n.prob)
        if self.draft is not None:  # the draft's thresholds adapt to what the target made of the draft's own nodes
            path = tree.path(last)
            k = next((i for i, n in enumerate(path) if i and not _by_model(n)), len(path))
            last_model, accepted_model = path[k - 1], k - 1
            n_all = tree.matched(last_model, [b for b in tree.branches if b.seq >= 0])
            if self.options.adaptive and n_all:  # LLMCad eq. 3 over the most matching branch
                c.alpha = next_alpha(c.alpha, accepted_model, n_all)
            if self.options.adaptive_split and self.options.tree:
                c.threshold = next_threshold(c.threshold, tree.took_branch(last_model),
                                             tree.had_branch([n for n in nodes if _by_model(n)]),
                                             accepted_model >= n_all)
        self.caches.keep(c, last, None if ended else out[-1])
        return out, ended

    def _target_pass(self, c: _Call, rc: list) -> None:
        """The target's llama_decode over the tree (its return code appended to rc), with the draft going on
        meanwhile when pipelining."""
        lib, t = self.lib, self.target
        if not self.options.pipeline or self.draft is None:
            rc.append(lib.llama_decode(t.ctx, c.tbatch.batch))
            return
        # The draft must not slow the target's pass down (LLMCad: the two never compute at once). It computes on
        # this thread alone (one draft thread) under SCHED_IDLE: the scheduler gives it a core only while no other
        # thread wants one, i.e. while the target's threads sleep waiting on the disk, and a target thread that
        # wakes takes the core back at once (nice 19 did not: its time slices held the target's barriers up, and
        # the target computed 1.5-2.4x slower). The target's threads are made by the worker, before this thread's
        # policy changes, so they keep theirs. When the pass ends, the draft's step under way is aborted (its
        # abort callback) rather than waited for.
        d = self.draft.settings.n_threads
        lib.llama_set_n_threads(self.draft.ctx, 1, 1)
        self.target_done = False

        def verify():
            rc.append(lib.llama_decode(t.ctx, c.tbatch.batch))
            self.target_done = True

        worker = threading.Thread(target=verify)
        worker.start()
        lib.llama_set_abort_callback(self.draft.ctx, self.abort, None)
        policy = _idle_thread()
        draft_s = c.stats.draft_s
        try:
            self._draft_during(c)
        finally:
            lib.llama_set_abort_callback(self.draft.ctx, lib.ggml_abort_callback(), None)  # NULL: no callback
            worker.join()
            lib.llama_set_n_threads(self.draft.ctx, d, d)
            c.stats.pipeline_draft_s += c.stats.draft_s - draft_s
            c.stats.draft_s = draft_s
            _restore_thread(policy)  # last: nothing above is skipped if it fails

    def _draft_during(self, c: _Call) -> None:
        """The speculative generation pipeline: while the target's pass runs, extend the most confident branch."""
        alive = [b for b in c.tree.branches if not b.done]
        if not alive:
            return
        branch = max(alive, key=lambda b: b.leaf.conf)
        n_late = 0
        while not self.target_done and n_late < self.n_nodes_max and not branch.done:
            if self.grower.grow(c, branch, siblings=False) is None:
                return
            n_late += 1

    def _sample(self, c: _Call, i: int) -> int:
        if self.target.settings.temp <= 0:
            logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.target.ctx, i), shape=(self.n_vocab,))
            return int(np.argmax(logits))
        return self.lib.llama_sampler_sample(c.sampler, self.target.ctx, i)

    def _judge(self, c: _Call, nodes: list[Node], last: Node) -> None:
        """Tell each drafter what the target made of its nodes: for each node whose parent the target accepted,
        whether it did too (drafters learn their chances from it), and the logits after every node (Token
        Recycling's table); count the nodes and acceptances of each drafter."""
        kept = set(map(id, c.tree.path(last)))
        for n in nodes[1:]:
            accepted = id(n) in kept
            for name in {d.name if d else "model" for d, _ in n.origins}:
                counts = c.stats.by_drafter.setdefault(name, [0, 0])
                counts[0] += 1
                counts[1] += accepted
            if id(n.parent) in kept:
                for d, kind in n.origins:
                    if d is not None:
                        d.judge(kind, accepted)
        learners = [d for d in self.drafters if d.wants_logits]
        if learners:
            # the rows of the accepted path and of the nodes just off it: a top-k over the vocabulary costs about
            # 1.5 ms a row, so not every row of a large tree
            rows = [i for i, n in enumerate(nodes) if id(n) in kept or (n.parent and id(n.parent) in kept)]
            # LEARN_ROWS at a time: a top-k over a stack of rows takes 12 bytes a logit (the copy, the indices), which
            # for a tree's 32 rows of a 256k vocabulary was 96 MiB the plan did not count (drafters.table_bytes does)
            for start in range(0, len(rows), free.LEARN_ROWS):
                chunk = rows[start:start + free.LEARN_ROWS]
                logits = np.stack([np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.target.ctx, i),
                                                         shape=(self.n_vocab,)) for i in chunk])
                for d in learners:
                    d.learn([nodes[i].token for i in chunk], logits)
