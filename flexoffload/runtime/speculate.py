"""Token-tree speculation with a resident draft model (LLMCad), on the streaming runtime.

The draft grows a tree of continuations: every candidate whose probability passes `threshold` opens a branch, and the
branch pacer (max-min fairness over cumulative confidence, LLMCad eq. 1-2) picks which branch gets the next draft
token. Branches are sequences of one unified KV cache, so shared prefixes are decoded once and each node attends only
to its ancestors. When the most confident branch's cumulative confidence falls below alpha (eq. 3 adapts it after
each verification) or the tree reaches its node budget, the target checks the whole tree in one forward pass: one
pass over its streamed weights, whatever the tree's size. The longest path the target agrees with is kept, then the
target's own next token. While the target's pass waits on the disk, the draft goes on along the most confident
branch; those tokens are kept when verification ends on that branch and the target's token is the draft's guess.

Lossless: at every node the target's own sampler picks a token (greedy: the argmax of its logits), and the walk
descends only while that token is a child, so each output token is drawn from the target's distribution exactly
(children here are chosen deterministically from the draft, so no rejection correction is needed).

The tree itself (nodes, branches, the pacer, the walk) is spectree.py; this module runs it on the two models: the
draft's steps, the target's pass over a tree, the pipeline, and the KV bookkeeping, in both models: sequence 0 holds the accepted history; branch sequences are copies of their parent's
cells up to the fork (`llama_memory_seq_cp` only adds the sequence id to shared cells). After a verification the kept
path is moved into sequence 0 and every other sequence is dropped, which frees the rejected cells.

Free drafters (drafters.py: n-grams of the context, Token Recycling) add their branches to the tree before each pass,
beside the draft's or, without a draft model, alone: then no draft Engine is loaded and the tree costs no memory but
the drafters' tables. Their nodes are never in the draft's cache; a path through them leaves the draft the tokens it
has not seen as its backlog.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from flexoffload import FlexoffloadError, native
from flexoffload.gguf.model import Model, load
from flexoffload.plan.costmodel import looked_up_only
from flexoffload.plan.plans import override_patterns
from flexoffload.plan.planners import is_small
from flexoffload.runtime import drafters as free
from flexoffload.runtime.engine import Engine, Result, TextOut, stream_timings
from flexoffload.runtime.spectree import (MAX_BRANCHES, MAX_NODES, MIN_NODES, Branch, Node, Options, Stats, Tree,
                                          next_alpha, next_threshold)

DEAD_SEQ = MAX_BRANCHES  # the target's sequence for rejected cells kept occupied (see Speculator._bury)
FREE_NODES = 16  # free drafters' node budget where neither --draft-max nor the cost of a node is known
FREE_NODES_MAX = 32  # and where the cost of a node is known (chosen by it): the target's logits rows


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


class _Batch:
    """A llama_batch that can carry a tree: each token with its position, sequences and whether it gets logits."""

    def __init__(self, lib, n_max: int, n_seq_max: int):
        self.lib, self.n_max = lib, n_max
        self.batch = lib.llama_batch_init(n_max, 0, n_seq_max)

    def fill(self, items: list[tuple[int, int, list[int], bool]]) -> None:
        if len(items) > self.n_max:
            raise FlexoffloadError(f"a batch of {len(items)} tokens exceeds {self.n_max}")
        b = self.batch
        for i, (token, pos, seqs, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, len(seqs), int(logits)
            for j, s in enumerate(seqs):
                b.seq_id[i][j] = s
        b.n_tokens = len(items)

    def free(self) -> None:
        if self.batch is not None:
            self.lib.llama_batch_free(self.batch)
            self.batch = None


def _by_model(node: Node) -> bool:
    """Whether the draft model drafted the node (a free drafter may have proposed it too)."""
    return any(d is None for d, _ in node.origins)


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


@dataclass
class _Call:
    """What one generate call keeps between its steps."""
    tbatch: _Batch  # the target's: a tree a pass
    dbatch: _Batch | None  # the draft's: a path a step (None: no draft model)
    sampler: object  # the target's llama_sampler chain
    pos_limit: int  # the last position the context holds
    alpha: float  # the fallback threshold (LLMCad eq. 3)
    threshold: float  # the branch threshold (spectree.next_threshold)
    tree: Tree | None = None
    stats: Stats = field(default_factory=Stats)
    backlog: list[int] = field(default_factory=list)  # tokens the draft has yet to decode before the tree's nodes
    free_seqs: list[int] = field(default_factory=list)  # the draft's sequences no branch holds
    t_pass: float | None = None  # a target pass, seconds (smoothed)
    t_token: float | None = None  # a draft token, seconds (smoothed)
    pass_nodes: list[Node] = field(default_factory=list)  # the last pass's nodes, in batch order
    pass_seqs: dict[int, list[int]] = field(default_factory=dict)  # and the branches each lies on
    history: list[int] = field(default_factory=list)  # prompt and output, the tree's root last


class Speculator:
    """Generation by the target model, sped up by token trees from a draft model and/or free drafters
    (drafters.py). The engines are loaded by the caller: the target with n_outputs and n_seq_max for a tree (see
    `target_settings`), the draft (None: free drafters alone) resident."""

    def __init__(self, target: Engine, draft: Engine | None, options: Options | None = None,
                 drafters: list[free.Drafter] = ()):
        self.target, self.draft, self.options = target, draft, options or Options()
        self.drafters = list(drafters)
        if draft is None and not self.drafters:
            raise FlexoffloadError("speculation needs a draft model or a free drafter")
        self.lib = target.lib
        self.n_nodes_max = min(target.settings.n_outputs, MAX_NODES)
        n_seq = min(target.settings.n_seq_max, draft.settings.n_seq_max if draft else MAX_BRANCHES, MAX_BRANCHES)
        if self.n_nodes_max < 2 or n_seq < 1:
            raise FlexoffloadError("speculation needs a target with n_outputs >= 2")
        self.n_seq = n_seq if self.options.tree else 1
        tv = self.lib.llama_vocab_n_tokens(target.vocab)
        dv = self.lib.llama_vocab_n_tokens(draft.vocab) if draft else tv
        if tv != dv:
            raise FlexoffloadError(f"the draft's vocabulary ({dv} tokens) is not the target's ({tv})")
        self.n_vocab = tv
        # the pipeline: set once the target's pass is done; the draft's llama_decode then aborts (see _target_pass)
        self.target_done = False
        self.abort = self.lib.ggml_abort_callback(lambda data: self.target_done)
        self.call: _Call | None = None

    # --- the draft ----------------------------------------------------------------------------------------------

    def draft_decode(self, tokens: list[int], pos0: int, seq: int) -> np.ndarray | None:
        """Decode tokens at consecutive positions in one draft sequence; the probabilities after the last. None if
        the pipeline aborted it (the target's pass ended): then none of the tokens stays in the draft's cache."""
        lib, d, c = self.lib, self.draft, self.call
        t0 = time.perf_counter()
        for i in range(0, len(tokens), d.n_batch):
            chunk = tokens[i:i + d.n_batch]
            last = i + len(chunk) == len(tokens)
            c.dbatch.fill([(t, pos0 + i + j, [seq], last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
            rc = lib.llama_decode(d.ctx, c.dbatch.batch)
            if rc == 2:  # aborted: llama.cpp dropped this batch's cells; drop the earlier batches' too
                lib.llama_memory_seq_rm(lib.llama_get_memory(d.ctx), seq, pos0, -1)
                c.stats.draft_s += time.perf_counter() - t0
                return None
            if rc != 0:
                raise FlexoffloadError(f"the draft's llama_decode failed ({rc}): {d.log.last_error()}")
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(d.ctx, -1), shape=(self.n_vocab,))
        probs = _softmax(logits.astype(np.float64))
        c.stats.draft_s += time.perf_counter() - t0
        return probs

    def _grow(self, branch: Branch, siblings: bool) -> list[Node] | None:
        """One draft step on a branch: decode what of its path the draft has not seen, then add the top candidate
        as its next node, and (siblings) every other candidate past the threshold as the start of a new branch.
        None, and nothing changed, if the pipeline aborted the step."""
        c, tree = self.call, self.call.tree
        leaf = branch.leaf
        todo = [n for n in tree.path(leaf) if not n.decoded]
        probs = self.draft_decode(c.backlog + [n.token for n in todo], todo[0].pos - len(c.backlog), branch.seq)
        if probs is None:
            return None
        c.backlog = []
        for n in todo:
            n.decoded = True
        order = np.argpartition(probs, -4)[-4:]
        order = order[np.argsort(-probs[order])]
        added = []
        for rank, token in enumerate(int(t) for t in order):
            p = float(probs[token])
            if rank > 0 and (not siblings or p < c.threshold or len(tree.branches) >= self.n_seq):
                break
            node = tree.add(leaf, token, p)
            node.origins.append((None, rank))  # the draft model's
            added.append(node)
            if rank == 0:
                branch.leaf, branch.length = node, branch.length + 1
                grown = branch
            else:  # a new branch: the draft's cells of the path so far, shared
                seq = c.free_seqs.pop()
                mem = self.lib.llama_get_memory(self.draft.ctx)
                self.lib.llama_memory_seq_rm(mem, seq, -1, -1)
                self.lib.llama_memory_seq_cp(mem, branch.seq, seq, -1, leaf.pos + 1)
                grown = Branch(seq, node, branch.length)
                tree.branches.append(grown)
            if self.lib.llama_vocab_is_eog(self.draft.vocab, token) or node.pos + 1 >= c.pos_limit:
                grown.done = True
        return added

    def _draft_tree(self, budget: int) -> None:
        tree = self.call.tree
        while tree.n_nodes < budget:
            branch = tree.next_branch(self.options.pacer)
            if branch is None:
                return
            self._grow(branch, siblings=self.options.tree)
            if self.options.adaptive and tree.confidence() < self.call.alpha:
                return

    # --- the free drafters ---------------------------------------------------------------------------------------

    def _add_free(self, budget: int) -> None:
        """The free drafters' branches merged into the tree, within what is left of the node budget and of the
        sequences: the most confident nodes, each with its parent, while a node's confidence (the tokens it is
        expected to add) pays for what it adds to the pass (node_s against the seconds an output token takes)."""
        c, tree = self.call, self.call.tree
        n_left = budget - tree.n_nodes
        if not self.drafters or n_left <= 0:
            return
        proposals = [(d, p) for d in self.drafters for p in d.propose(c.history, n_left)]
        if not proposals:
            return
        min_conf = 0.0
        if self.options.node_s > 0 and c.t_pass:
            per_pass = c.stats.n_emitted / c.stats.n_verify if c.stats.n_verify else 1.0
            min_conf = self.options.node_s * per_pass / c.t_pass
        # a branch of the free drafters alone may grow on; the draft model's keep their leaves (its cache)
        growable = [b for b in tree.branches if self.draft is None or b.seq < 0]
        n_leaves = self.n_seq - len(tree.branches) + sum(1 for b in growable if b.leaf is tree.root)
        n_hidden = max(self.options.hidden_nodes - (tree.n_nodes - 1), 0)  # the draft model's nodes come first
        for picks in free.merge(proposals, n_left, n_leaves, min_conf, n_hidden):
            path, node = [], tree.root
            for pick in picks:  # how far the tree has the path already
                node = next((ch for ch in node.children if ch.token == pick.token), None)
                if node is None:
                    break
                path.append(node)
            leaf = path[-1] if path else tree.root
            owner = next((b for b in growable if b.leaf is leaf), None) if len(path) < len(picks) else None
            if len(path) < len(picks) and owner is None:
                if len(tree.branches) >= self.n_seq:
                    continue
                owner = Branch(-1, leaf, 0, done=True)  # no draft sequence: the draft never grows it
                tree.branches.append(owner)
                growable.append(owner)
            for pick in picks[len(path):]:
                leaf = tree.add(leaf, pick.token, pick.prob)
                path.append(leaf)
            for node, pick in zip(path, picks):
                node.origins.extend(pick.origins)
            if owner is not None:
                owner.leaf = leaf

    def _judge(self, nodes: list[Node], last: Node) -> None:
        """Tell each drafter what the target made of its nodes: for each node whose parent the target accepted,
        whether it did too (drafters learn their chances from it), and the logits after every node (Token
        Recycling's table); count the nodes and acceptances of each drafter."""
        c = self.call
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
            logits = np.stack([np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.target.ctx, i),
                                                     shape=(self.n_vocab,)) for i in rows])
            for d in learners:
                d.learn([nodes[i].token for i in rows], logits)

    # --- the target ---------------------------------------------------------------------------------------------

    def _verify(self) -> tuple[list[int], bool]:
        """One target pass over the tree; the accepted tokens then the target's own, and whether generation ended."""
        lib, t, c, tree = self.lib, self.target, self.call, self.call.tree
        nodes, seqs = tree.for_pass(self.n_nodes_max)
        mem = lib.llama_get_memory(t.ctx)
        for i in range(1, len(tree.branches)):
            lib.llama_memory_seq_rm(mem, i, -1, -1)
            lib.llama_memory_seq_cp(mem, 0, i, -1, -1)
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
            self._target_pass(rc)
        finally:
            native.set_tiled_matmul(-1)
        t_pass = time.perf_counter() - t0
        c.stats.target_s += t_pass
        if t.settings.strategy != "mmap":
            c.stats.stall_s += stream.stats(t.model, layers=False).t_stall_s - stall0
        if rc[0] != 0:
            raise FlexoffloadError(f"the target's llama_decode failed ({rc[0]}): {t.log.last_error()}")
        c.t_pass = t_pass if c.t_pass is None else 0.5 * (c.t_pass + t_pass)
        c.stats.n_verify += 1

        out, last, ended = tree.walk(nodes, self._sample, lambda token: lib.llama_vocab_is_eog(t.vocab, token))
        accepted = len(out) - 1
        c.stats.n_accepted += accepted
        c.stats.n_emitted += len(out)
        self._judge(nodes, last)
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
        if not ended:
            self._keep(last, out[-1])
        return out, ended

    def _target_pass(self, rc: list) -> None:
        """The target's llama_decode over the tree (its return code appended to rc), with the draft going on
        meanwhile when pipelining."""
        lib, t, c = self.lib, self.target, self.call
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
            self._draft_during()
        finally:
            lib.llama_set_abort_callback(self.draft.ctx, lib.ggml_abort_callback(), None)  # NULL: no callback
            worker.join()
            lib.llama_set_n_threads(self.draft.ctx, d, d)
            c.stats.pipeline_draft_s += c.stats.draft_s - draft_s
            c.stats.draft_s = draft_s
            _restore_thread(policy)  # last: nothing above is skipped if it fails

    def _draft_during(self) -> None:
        """The speculative generation pipeline: while the target's pass runs, extend the most confident branch."""
        alive = [b for b in self.call.tree.branches if not b.done]
        if not alive:
            return
        branch = max(alive, key=lambda b: b.leaf.conf)
        n_late = 0
        while not self.target_done and n_late < self.n_nodes_max and not branch.done:
            if self._grow(branch, siblings=False) is None:
                return
            n_late += 1

    def _sample(self, i: int) -> int:
        if self.target.settings.temp <= 0:
            logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.target.ctx, i), shape=(self.n_vocab,))
            return int(np.argmax(logits))
        return self.lib.llama_sampler_sample(self.call.sampler, self.target.ctx, i)

    # --- the KV caches ------------------------------------------------------------------------------------------

    def _keep(self, last: Node, token: int) -> None:
        """Make the accepted path history in both caches and start the next tree at the target's token (or at the
        node the draft already made for it during the pass, with what it drafted below)."""
        c, tree = self.call, self.call.tree
        top = tree.root.pos
        reuse = next((n for n in last.children if not n.in_pass and n.token == token), None)

        # target: root .. last are in its cache now, in the sequences of the branches through them
        self._bury(last)
        self._move_to_history(self.target.ctx, tree.owner(last), top, last.pos + 1, range(1, len(tree.branches)))
        if self.draft is None:
            c.tree = Tree(Node(token, None, last.pos + 1, 1.0, 1.0))
            return

        # draft: keep the decoded part of the path (and of the reused chain)
        kept_leaf = last
        if reuse is not None:
            kept_leaf = reuse
            while kept_leaf.children:  # drafted during the pass: a chain
                kept_leaf = kept_leaf.children[0]
        decoded = [n for n in tree.path(kept_leaf) if n.decoded]
        end = decoded[-1].pos + 1 if decoded else top
        # the decoded nodes are in the draft's sequence of the first branch through the deepest (a free drafter's
        # branches come after the draft's and are never decoded)
        seq = tree.branches[tree.owner(decoded[-1])].seq if decoded else 0
        self._move_to_history(self.draft.ctx, seq, top, end, [b.seq for b in tree.branches if b.seq > 0])
        c.backlog = [n.token for n in tree.path(last) if not n.decoded]
        c.free_seqs = list(range(self.n_seq - 1, 0, -1))

        if reuse is not None:
            c.stats.n_reused += len(kept_leaf.path_from(reuse))
            c.tree = Tree(reuse, kept_leaf)
        else:
            c.tree = Tree(Node(token, None, last.pos + 1, 1.0, 1.0))

    def _bury(self, last: Node) -> None:
        """Keep the target's rejected cells that lie before the last accepted one occupied, in a sequence nothing
        attends to. Freed, they would be refilled by the next tokens, whose cells would then come before older
        history; flash attention sums over cells in cell order, in f16, so the logits would differ in their last
        bits from a run without speculation, and a near tie could flip the greedy token. Cells after the last
        accepted one are freed: the next tokens fill them in position order. A speculation run spends these
        cells of its context (-c), at most the tree's rejected nodes per verification."""
        lib, c = self.lib, self.call
        mem = lib.llama_get_memory(self.target.ctx)
        kept = set(map(id, c.tree.path(last)))
        for n in c.pass_nodes:
            if n is last:
                break
            if id(n) not in kept:
                lib.llama_memory_seq_cp(mem, c.pass_seqs[id(n)][0], DEAD_SEQ, n.pos, n.pos + 1)

    def _move_to_history(self, ctx, seq: int, top: int, end: int, others) -> None:
        """Cells [top, end) of seq become sequence 0's; everything else past the history goes."""
        lib = self.lib
        mem = lib.llama_get_memory(ctx)
        lib.llama_memory_seq_rm(mem, seq, end, -1)
        if seq != 0:
            lib.llama_memory_seq_rm(mem, 0, top, -1)
            lib.llama_memory_seq_cp(mem, seq, 0, top, end)
        for s in others:
            lib.llama_memory_seq_rm(mem, s, -1, -1)

    def _node_budget(self) -> int:
        """As many nodes as the draft makes in one target pass: drafting longer costs more than verifying. Free
        drafters alone: all the target's rows (their nodes are chosen by what a node costs, _add_free), or
        FREE_NODES where that cost is unknown."""
        c = self.call
        if self.options.max_nodes:
            return min(self.options.max_nodes, self.n_nodes_max)
        if self.draft is None:
            return self.n_nodes_max if self.options.node_s > 0 else min(FREE_NODES, self.n_nodes_max)
        if not c.t_pass or not c.t_token:
            return min(16, self.n_nodes_max)
        return max(MIN_NODES, min(self.n_nodes_max, int(c.t_pass / c.t_token)))

    # --- generation ---------------------------------------------------------------------------------------------

    def generate(self, prompt: str, n_predict: int, on_text=None) -> Result:
        lib, t, d = self.lib, self.target, self.draft
        n_ctx = min(t.n_ctx, d.n_ctx) if d else t.n_ctx
        if d:
            d.start(prompt, n_ctx)
        prompt_tokens = t.start(prompt, n_ctx)  # the target's last: its streaming statistics start here
        c = self.call = _Call(tbatch=_Batch(lib, max(t.n_batch, self.n_nodes_max), MAX_BRANCHES),
                              dbatch=_Batch(lib, d.n_batch, 1) if d else None, sampler=t._sampler(),
                              pos_limit=n_ctx - 1, alpha=self.options.alpha, threshold=self.options.threshold)
        for drafter in self.drafters:
            drafter.reset()
        text_out, stop = TextOut(t, on_text), "limit"
        tokens = text_out.tokens
        try:
            t_start = time.perf_counter()
            if d and len(prompt_tokens) > 1:  # both models read the prompt before the first token
                self.draft_decode(prompt_tokens[:-1], 0, 0)
            c.backlog = [prompt_tokens[-1]]
            for i in range(0, len(prompt_tokens), t.n_batch):  # the target's prompt passes give the first token
                t_pass = time.perf_counter()
                t._decode(prompt_tokens[i:i + t.n_batch])
            first = lib.llama_sampler_sample(c.sampler, t.ctx, -1)
            t_first = time.perf_counter()
            c.t_pass = t_first - t_pass  # a pass over the target's weights, to size the first tree
            c.free_seqs = list(range(self.n_seq - 1, 0, -1))
            c.tree = Tree(Node(first, None, len(prompt_tokens), 1.0, 1.0))
            c.history = list(prompt_tokens) + [first]
            if lib.llama_vocab_is_eog(t.vocab, first):
                stop = "eog"
            else:
                text_out.emit(first)
            while stop != "eog" and (n_predict < 0 or len(tokens) < n_predict):
                if c.tree.root.pos + 1 >= c.pos_limit:
                    stop = "context"
                    break
                steps0, draft0 = c.tree.n_nodes, c.stats.draft_s
                budget = min(self._node_budget(), c.pos_limit - c.tree.root.pos)
                if d:
                    self._draft_tree(budget)
                grown = c.tree.n_nodes - steps0
                if grown > 0:
                    per_token = (c.stats.draft_s - draft0) / grown
                    c.t_token = per_token if c.t_token is None else 0.5 * (c.t_token + per_token)
                t_free = time.perf_counter()
                # beside a draft's tree, the free drafters' nodes cost no draft time: up to the target's rows
                self._add_free(min(self.n_nodes_max, c.pos_limit - c.tree.root.pos) if d else budget)
                c.stats.draft_s += time.perf_counter() - t_free
                out, ended = self._verify()
                c.history += out
                for token in out:
                    if lib.llama_vocab_is_eog(t.vocab, token):
                        stop = "eog"
                        break
                    text_out.emit(token)
                    if n_predict >= 0 and len(tokens) >= n_predict:
                        break
                if ended:
                    stop = "eog"
            t_end = time.perf_counter()
        finally:
            lib.llama_sampler_free(c.sampler)
            c.tbatch.free()
            if c.dbatch:
                c.dbatch.free()
        timings = c.stats.to_dict(len(tokens))
        if t.settings.strategy != "mmap":  # the target's reads only (a draft's streamed rows are the draft's)
            timings.update(stream_timings(t_end - t_start, t.model))
        if self.drafters:
            timings["free_table_bytes"] = sum(x.table_bytes for x in self.drafters)
        return Result.of(prompt_tokens, text_out, (t_start, t_first, t_end), len(tokens) - 1,
                         t.load_s + (d.load_s if d else 0.0), t.settings.strategy + "+tree", stop, timings)


def run(target_path, settings, draft_path, options: Options, prompt: str, n_predict: int, on_text=None,
        free_drafters: tuple[str, ...] = (), store=None) -> Result:
    """Load the target (as settings say: streamed by its plan, or mmap) and the draft (resident; None: free
    drafters alone, no draft loaded), and generate. store: where Token Recycling's table outlives the run (saved
    when the generation ends whole)."""
    if draft_path is None:
        with Engine(target_path, target_settings(settings, options.max_nodes or free_nodes(options))) as target:
            chosen = free.make(free_drafters, target.lib.llama_vocab_n_tokens(target.vocab), store)
            result = Speculator(target, None, options, chosen).generate(prompt, n_predict, on_text)
    else:
        with Engine(draft_path, draft_settings(settings, load(draft_path))) as draft, \
                Engine(target_path, target_settings(settings, options.max_nodes)) as target:
            chosen = free.make(free_drafters, target.lib.llama_vocab_n_tokens(target.vocab), store)
            result = Speculator(target, draft, options, chosen).generate(prompt, n_predict, on_text)
    for drafter in chosen:
        drafter.save()
    return result


def free_nodes(options: Options) -> int:
    """The rows a target keeps for free drafters alone (each row is n_vocab floats of logits)."""
    return FREE_NODES_MAX if options.node_s > 0 else FREE_NODES


def target_settings(settings, max_nodes: int | None = None):
    """The target's context: a logits row per tree node, a sequence per branch and one for rejected cells."""
    from dataclasses import replace

    return replace(settings, n_outputs=max(max_nodes or MAX_NODES, MAX_BRANCHES + 1), n_seq_max=MAX_BRANCHES + 1)


def draft_by_rows(draft: Model) -> list[str]:
    """The draft's tensors read by rows, not kept: a token_embd used only for lookups (the draft has an output
    matrix of its own) costs one small read a draft token, and its memory goes to the target (89 MiB of the
    0.5B Qwen's 537). A token_embd the output is tied to stays: the output's matmul reads all of it every step."""
    return [t.name for t in draft.tensors if looked_up_only(draft, t) and not is_small(t)]


def draft_settings(settings, draft: Model):
    """The draft's: every tensor read once into memory but those read by rows (draft_by_rows); one output per
    step, but llama.cpp reserves at least one per sequence."""
    from dataclasses import replace

    patterns = override_patterns(draft_by_rows(draft), [t.name for t in draft.tensors])
    return replace(settings, strategy="stream", streamed_patterns=tuple(patterns), n_outputs=MAX_BRANCHES,
                   n_seq_max=MAX_BRANCHES)
