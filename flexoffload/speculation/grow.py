"""Drafting a token tree (TreeGrower): the draft model's steps, each growing a branch by its top candidate and opening
new branches for the others past the threshold, picked by the branch pacer; and the free drafters' branches merged
into the tree before each pass.

Apart from speculate.py because it is the drafting side of a call alone: it decodes in the draft's context and adds
nodes to the tree; the target's pass over the tree is verify.py's, and both share the KV bookkeeping (kvcache.py).
"""

from __future__ import annotations

import time

import numpy as np

from flexoffload import FlexoffloadError
from flexoffload.native import head as native_head
from flexoffload.speculation import drafters as free
from flexoffload.speculation.kvcache import TreeCaches
from flexoffload.speculation.state import _Call
from flexoffload.speculation.tree import Branch, Node, Options


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


class TreeGrower:
    """A tree's nodes from the draft (an Engine, resident; None: the free drafters alone) and the free drafters, in
    n_seq branches at most."""

    def __init__(self, lib, draft, options: Options, drafters: list[free.Drafter], caches: TreeCaches, n_seq: int,
                 n_vocab: int):
        self.lib, self.draft, self.options, self.drafters = lib, draft, options, drafters
        self.caches, self.n_seq, self.n_vocab = caches, n_seq, n_vocab
        # a draft head cut to the frequent tokens (gguf/headcut.py): its logits are -inf but at its rows, and
        # partitioning 120k equal zeros costs 7 ms a step (0.25 ms for the rows alone)
        self.cut = draft is not None and native_head.n_rows(draft.model) > 0
        self.live: np.ndarray | None = None  # the tokens the last step's logits were finite at (a cut head's)

    # --- the draft ----------------------------------------------------------------------------------------------

    def draft_decode(self, c: _Call, tokens: list[int], pos0: int, seq: int) -> np.ndarray | None:
        """Decode tokens at consecutive positions in one draft sequence; the probabilities after the last. None if
        the pipeline aborted it (the target's pass ended): then none of the tokens stays in the draft's cache."""
        lib, d = self.lib, self.draft
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
        if self.cut:
            self.live = np.flatnonzero(logits != -np.inf)
            probs = np.zeros(self.n_vocab)
            probs[self.live] = _softmax(logits[self.live].astype(np.float64))
        else:
            probs = _softmax(logits.astype(np.float64))
        c.stats.draft_s += time.perf_counter() - t0
        return probs

    def grow(self, c: _Call, branch: Branch, siblings: bool) -> list[Node] | None:
        """One draft step on a branch: decode what of its path the draft has not seen, then add the top candidate
        as its next node, and (siblings) every other candidate past the threshold as the start of a new branch.
        None, and nothing changed, if the pipeline aborted the step."""
        tree = c.tree
        leaf = branch.leaf
        todo = [n for n in tree.path(leaf) if not n.decoded]
        probs = self.draft_decode(c, c.backlog + [n.token for n in todo], todo[0].pos - len(c.backlog), branch.seq)
        if probs is None:
            return None
        c.backlog = []
        for n in todo:
            n.decoded = True
        live = self.live if self.cut and self.live is not None and len(self.live) >= 4 else None
        order = np.argpartition(probs, -4)[-4:] if live is None else live[np.argpartition(probs[live], -4)[-4:]]
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
                self.caches.fork_draft(branch.seq, seq, leaf.pos + 1)
                grown = Branch(seq, node, branch.length)
                tree.branches.append(grown)
            if self.lib.llama_vocab_is_eog(self.draft.vocab, token) or node.pos + 1 >= c.pass_end:
                grown.done = True
        return added

    def draft_tree(self, c: _Call, budget: int) -> None:
        """Draft steps, each on the branch the pacer picks, until the tree has budget nodes or (adaptive) its
        confidence falls below alpha."""
        tree = c.tree
        while tree.n_nodes < budget:
            branch = tree.next_branch(self.options.pacer)
            if branch is None:
                return
            self.grow(c, branch, siblings=self.options.tree)
            if self.options.adaptive and tree.confidence() < c.alpha:
                return

    def draft_measured(self, c: _Call, budget: int) -> int:
        """Draft steps by the run's measurements (control.Controller): each on the branch whose next node the target is
        likeliest to accept (its path's chance times the measured rate at the next depth), while that chance pays for
        the node, up to budget nodes; a node's own chance follows the probability the draft gave it
        (Measured.prob_rate), or its depth's rate (a side candidate's: the side rate) where that is unmeasured. Then the
        leaves that do not pay for their rows are dropped. The draft steps taken."""
        tree, control = c.tree, c.control
        m, steps = control.m, 0
        while tree.n_nodes < budget:
            best, best_p, best_depth = None, 0.0, 0
            for b in tree.branches:
                if b.done or b.seq < 0:
                    continue
                depth = b.leaf.pos - tree.root.pos + 1
                p = b.leaf.est * m.rate(depth)
                if p > best_p:
                    best, best_p, best_depth = b, p, depth
            if best is None or not control.pays(best_p, best_depth):
                break
            parent = best.leaf
            added = self.grow(c, best, siblings=self.options.tree)
            if added is None:
                break
            steps += 1
            rates = (m.rate(best_depth), m.side_rate())  # where its probability's tenth is unmeasured
            for rank, node in enumerate(added):
                node.est = parent.est * m.prob_rate(node.prob, rates[rank > 0])
        self._drop_unpaid(c)
        return steps

    def _drop_unpaid(self, c: _Call) -> None:
        """A draft branch's last node, drafted but unlikely, costs a row of the pass it would seldom repay: left out
        (it was never decoded in the draft's cache). Only a chain's own last node, where no other branch or side
        candidate hangs on its parent, so no sequence loses a cell."""
        tree, control = c.tree, c.control
        for b in tree.branches:
            leaf = b.leaf
            if (b.seq >= 0 and leaf is not tree.root and not leaf.decoded and not leaf.children
                    and leaf.parent.children == [leaf] and not control.keeps(leaf.est)
                    and sum(1 for o in tree.branches if o.leaf is leaf) == 1):
                leaf.parent.children.remove(leaf)
                tree.n_nodes -= 1
                b.leaf, b.length, b.done = leaf.parent, b.length - 1, True

    # --- the free drafters ---------------------------------------------------------------------------------------

    def add_free(self, c: _Call, budget: int) -> None:
        """The free drafters' branches merged into the tree, within what is left of the node budget and of the
        sequences: the most confident nodes, each with its parent, while a node's confidence (the tokens it is
        expected to add) pays for what it adds to the pass (node_s against the seconds an output token takes)."""
        tree = c.tree
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
