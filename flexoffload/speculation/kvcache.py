"""The KV bookkeeping of token-tree speculation, in both models' caches (TreeCaches).

Sequence 0 holds the accepted history; branch sequences are copies of their parent's cells up to the fork
(`llama_memory_seq_cp` only adds the sequence id to shared cells). After a verification the kept path is moved into
sequence 0 and every other sequence is dropped, which frees the rejected cells; the target's rejected cells before
the last accepted one stay occupied, in DEAD_SEQ (TreeCaches.bury).

Apart from speculate.py because it is llama.cpp's memory calls alone, whatever drafted the tree or verified it: the
drafting (grow.py) forks the draft's branches here, the target's pass (verify.py) opens the target's and keeps
what it accepted.
"""

from __future__ import annotations

from flexoffload.speculation.tree import MAX_BRANCHES, Node, Tree
from flexoffload.speculation.state import _Call

DEAD_SEQ = MAX_BRANCHES  # the target's sequence for rejected cells kept occupied (see TreeCaches.bury)


class TreeCaches:
    """The target's KV cache and the draft's (None: no draft model) around a tree's passes: n_seq sequences a
    model, one a branch."""

    def __init__(self, lib, target, draft, n_seq: int):
        self.lib, self.target, self.draft, self.n_seq = lib, target, draft, n_seq

    def open_target(self, n_branches: int) -> None:
        """Before the target's pass over a tree of n_branches: each branch's sequence a copy of the history."""
        lib = self.lib
        mem = lib.llama_get_memory(self.target.ctx)
        for i in range(1, n_branches):
            lib.llama_memory_seq_rm(mem, i, -1, -1)
            lib.llama_memory_seq_cp(mem, 0, i, -1, -1)

    def fork_draft(self, parent: int, seq: int, end: int) -> None:
        """A new branch in the draft's cache: sequence seq emptied, then sharing the parent's cells before end."""
        mem = self.lib.llama_get_memory(self.draft.ctx)
        self.lib.llama_memory_seq_rm(mem, seq, -1, -1)
        self.lib.llama_memory_seq_cp(mem, parent, seq, -1, end)

    def keep(self, c: _Call, last: Node, token: int | None) -> None:
        """Make the accepted path history in both caches and start the next tree at the target's token (or at the
        node the draft already made for it during the pass, with what it drafted below). token None: generation
        ended (end of text): the caches keep the history, no next tree."""
        tree = c.tree
        top = tree.root.pos
        reuse = next((n for n in last.children if not n.in_pass and n.token == token), None)

        # target: root .. last are in its cache now, in the sequences of the branches through them
        self.bury(c, last)
        self.move_to_history(self.target.ctx, tree.owner(last), top, last.pos + 1, range(1, len(tree.branches)))
        if self.draft is None:
            if token is not None:
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
        self.move_to_history(self.draft.ctx, seq, top, end, [b.seq for b in tree.branches if b.seq > 0])
        # what the draft has not decoded: a pass it did not draft in (speccontrol) leaves the earlier backlog too
        c.backlog = c.backlog + [n.token for n in tree.path(last) if not n.decoded]
        c.free_seqs = list(range(self.n_seq - 1, 0, -1))

        if token is None:
            return
        if reuse is not None:
            c.stats.n_reused += len(kept_leaf.path_from(reuse))
            c.tree = Tree(reuse, kept_leaf)
        else:
            c.tree = Tree(Node(token, None, last.pos + 1, 1.0, 1.0))

    def drop_tree(self, c: _Call) -> None:
        """Undo what a tree left in the caches before its pass: the target's branch sequences (copies of the
        history), and in the draft every branch and what the draft decoded past the history."""
        lib = self.lib
        mem = lib.llama_get_memory(self.target.ctx)
        for i in range(1, len(c.tree.branches)):
            lib.llama_memory_seq_rm(mem, i, -1, -1)
        if self.draft is not None:
            mem = lib.llama_get_memory(self.draft.ctx)
            lib.llama_memory_seq_rm(mem, 0, c.tree.root.pos, -1)
            for seq in range(1, self.n_seq):
                lib.llama_memory_seq_rm(mem, seq, -1, -1)

    def bury(self, c: _Call, last: Node) -> None:
        """Keep the target's rejected cells that lie before the last accepted one occupied, in a sequence nothing
        attends to. Freed, they would be refilled by the next tokens, whose cells would then come before older
        history; flash attention sums over cells in cell order, in f16, so the logits would differ in their last
        bits from a run without speculation, and a near tie could flip the greedy token. Cells after the last
        accepted one are freed: the next tokens fill them in position order. A speculation run spends these
        cells of its context (-c), at most the tree's rejected nodes per verification."""
        lib = self.lib
        mem = lib.llama_get_memory(self.target.ctx)
        kept = set(map(id, c.tree.path(last)))
        for n in c.pass_nodes:
            if n is last:
                break
            if id(n) not in kept:
                lib.llama_memory_seq_cp(mem, c.pass_seqs[id(n)][0], DEAD_SEQ, n.pos, n.pos + 1)

    def move_to_history(self, ctx, seq: int, top: int, end: int, others) -> None:
        """Cells [top, end) of seq become sequence 0's; everything else past the history goes."""
        lib = self.lib
        mem = lib.llama_get_memory(ctx)
        lib.llama_memory_seq_rm(mem, seq, end, -1)
        if seq != 0:
            lib.llama_memory_seq_rm(mem, 0, top, -1)
            lib.llama_memory_seq_cp(mem, seq, 0, top, end)
        for s in others:
            lib.llama_memory_seq_rm(mem, s, -1, -1)
