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

KV bookkeeping, in both models: sequence 0 holds the accepted history; branch sequences are copies of their parent's
cells up to the fork (`llama_memory_seq_cp` only adds the sequence id to shared cells). After a verification the kept
path is moved into sequence 0 and every other sequence is dropped, which frees the rejected cells.
"""

from __future__ import annotations

import codecs
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import FlexoffloadError, native
from .costmodel import reads_rows
from .engine import Engine, Result
from .model import Model, load
from .plan import override_patterns
from .planners import is_small

THRESHOLD = 0.3  # a candidate this likely opens a branch (LLMCad)
ALPHA = 0.01  # starting fallback threshold on the tree-cumulative confidence (LLMCad)
MAX_BRANCHES = 16  # sequences per model: branches alive in one tree
MAX_NODES = 48  # cap on the tree's node budget (the target's batch, and its logits rows)
MIN_NODES = 4
DEAD_SEQ = MAX_BRANCHES  # the target's sequence for rejected cells kept occupied (see Speculator._bury)
# What a tree yields over the tuning prompts (HumanEval 0, 5, ..., 35; the tree with the defaults at 0.8x, -n 64;
# results/llmcad_tune.csv): tokens per target pass (509 in 59 passes), and draft steps per tree (its nodes, 14.6 a
# pass). Used only to predict whether speculation pays at a budget (predicted_tok_s).
TOKENS_PER_PASS = 8.6
DRAFT_STEPS = 14.6
# What verifying costs beyond a one-token pass: each further node of the tree, a share of the target's compute per
# token with every weight in memory. Verification uses the one-token kernels (patch 0008), so the nodes are near
# linear in compute: 17-token tree passes took 0.51-0.64 s, 9-token ones 0.32-0.45 s, against 0.045 s for one token
# (results/tree_mask_overhead.csv, all weights in memory): (0.58 - 0.33) / 8 / 0.045 = 0.7 a node.
VERIFY_SHARE = 0.7


@dataclass
class Options:
    tree: bool = True  # False: a linear chain (only the draft's top token)
    pacer: bool = True  # False: branches grow in turn (round robin)
    adaptive: bool = True  # False: verify only when the tree reaches its node budget
    pipeline: bool = False  # draft on while the target verifies (measured within noise on 2 cores: off by default)
    threshold: float = THRESHOLD
    alpha: float = ALPHA
    max_nodes: int | None = None  # node budget; None: from the measured target pass and draft token times


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


class Node:
    __slots__ = ("token", "parent", "pos", "prob", "conf", "children", "decoded", "in_pass")

    def __init__(self, token: int, parent: "Node | None", pos: int, prob: float, conf: float):
        self.token, self.parent, self.pos, self.prob, self.conf = token, parent, pos, prob, conf
        self.children: list[Node] = []
        self.decoded = False  # in the draft's KV cache
        self.in_pass = False  # part of the target pass being verified

    def path_from(self, top: "Node") -> list["Node"]:
        """The nodes from top (included) down to this one."""
        path, node = [], self
        while node is not top:
            path.append(node)
            node = node.parent
        path.append(top)
        return path[::-1]


@dataclass
class Branch:
    seq: int  # the draft's sequence id
    leaf: Node
    length: int = 0  # tokens drafted on this branch (T_x in LLMCad eq. 1)
    done: bool = False  # ended in end of generation, or out of room


@dataclass
class Stats:
    n_verify: int = 0
    n_drafted: int = 0  # tree nodes the target checked, roots excluded
    n_accepted: int = 0  # of those, kept
    n_reused: int = 0  # tokens drafted during verification and kept
    tree_sizes: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # drafting between target passes
    pipeline_draft_s: float = 0.0  # drafting during target passes (the pipeline), not on the critical path
    target_s: float = 0.0
    stall_s: float = 0.0

    def to_dict(self, n_gen: int) -> dict:
        sizes = self.tree_sizes or [0]
        return {
            "n_verify": self.n_verify,
            "tokens_per_pass": n_gen / self.n_verify if self.n_verify else 0.0,
            "acceptance_rate": self.n_accepted / self.n_drafted if self.n_drafted else 0.0,
            "n_drafted": self.n_drafted, "n_accepted": self.n_accepted, "n_reused": self.n_reused,
            "tree_size_mean": float(np.mean(sizes)), "tree_size_max": int(max(sizes)),
            "draft_s": self.draft_s, "pipeline_draft_s": self.pipeline_draft_s,
            "target_compute_s": max(self.target_s - self.stall_s, 0.0),
            "io_stall_s": self.stall_s, "target_s": self.target_s,
        }


def predicted_tok_s(pass_s: float, draft_token_s: float, target_token_s: float) -> float:
    """The decode speed speculation can be expected to reach: TOKENS_PER_PASS tokens for one target pass over a tree
    of DRAFT_STEPS nodes past its root and DRAFT_STEPS draft tokens (draft_token_s each). The pass: a one-token pass
    by the target's plan with the draft's memory taken out (pass_s), and VERIFY_SHARE of the target's compute per
    token (target_token_s, every weight in memory) for each further node."""
    return TOKENS_PER_PASS / (pass_s + DRAFT_STEPS * (draft_token_s + VERIFY_SHARE * target_token_s))


def pace(branches: list[Branch], n_nodes: int) -> Branch | None:
    """LLMCad's branch pacer (eq. 1-2): the next draft token goes to the branch furthest below its share of the
    tree, f(x) = M * C_x / sum(C) - T_x, so lengths follow cumulative confidence (max-min fairness)."""
    alive = [b for b in branches if not b.done]
    if not alive:
        return None
    total = sum(b.leaf.conf for b in alive) or 1.0
    return max(alive, key=lambda b: n_nodes * b.leaf.conf / total - b.length)


def round_robin(branches: list[Branch]) -> Branch | None:
    """Without the pacer: the shortest branch grows, so all grow in turn."""
    alive = [b for b in branches if not b.done]
    return min(alive, key=lambda b: b.length) if alive else None


def next_alpha(alpha: float, n_correct: int, n_all: int) -> float:
    """LLMCad eq. 3: halve the fallback threshold when the most matching branch was all correct, else set it to
    the branch's error fraction."""
    return alpha * 0.5 if n_correct >= n_all else (n_all - n_correct) / n_all


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


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


class Speculator:
    """Generation by the target model, sped up by a draft model's token trees. Both engines are loaded by the
    caller: the target with n_outputs and n_seq_max for a tree (see `target_settings`), the draft resident."""

    def __init__(self, target: Engine, draft: Engine, options: Options | None = None):
        self.target, self.draft, self.options = target, draft, options or Options()
        self.lib = target.lib
        self.n_nodes_max = min(target.settings.n_outputs, MAX_NODES)
        n_seq = min(target.settings.n_seq_max, draft.settings.n_seq_max, MAX_BRANCHES)
        if self.n_nodes_max < 2 or n_seq < 1:
            raise FlexoffloadError("speculation needs a target with n_outputs >= 2")
        self.n_seq = n_seq if self.options.tree else 1
        tv, dv = self.lib.llama_vocab_n_tokens(target.vocab), self.lib.llama_vocab_n_tokens(draft.vocab)
        if tv != dv:
            raise FlexoffloadError(f"the draft's vocabulary ({dv} tokens) is not the target's ({tv})")
        self.n_vocab = tv
        # the pipeline: set once the target's pass is done; the draft's llama_decode then aborts (see _target_pass)
        self._target_done = False
        self._abort = self.lib.ggml_abort_callback(lambda data: self._target_done)

    # --- the draft ----------------------------------------------------------------------------------------------

    def _draft_decode(self, tokens: list[int], pos0: int, seq: int) -> np.ndarray | None:
        """Decode tokens at consecutive positions in one draft sequence; the probabilities after the last. None if
        the pipeline aborted it (the target's pass ended): then none of the tokens stays in the draft's cache."""
        lib, d = self.lib, self.draft
        t0 = time.perf_counter()
        for i in range(0, len(tokens), d.n_batch):
            chunk = tokens[i:i + d.n_batch]
            last = i + len(chunk) == len(tokens)
            self._dbatch.fill([(t, pos0 + i + j, [seq], last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
            rc = lib.llama_decode(d.ctx, self._dbatch.batch)
            if rc == 2:  # aborted: llama.cpp dropped this batch's cells; drop the earlier batches' too
                lib.llama_memory_seq_rm(lib.llama_get_memory(d.ctx), seq, pos0, -1)
                self.stats.draft_s += time.perf_counter() - t0
                return None
            if rc != 0:
                raise FlexoffloadError(f"the draft's llama_decode failed ({rc}): {d.log.last_error()}")
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(d.ctx, -1), shape=(self.n_vocab,))
        probs = _softmax(logits.astype(np.float64))
        self.stats.draft_s += time.perf_counter() - t0
        return probs

    def _grow(self, branch: Branch, siblings: bool) -> list[Node] | None:
        """One draft step on a branch: decode what of its path the draft has not seen, then add the top candidate
        as its next node, and (siblings) every other candidate past the threshold as the start of a new branch.
        None, and nothing changed, if the pipeline aborted the step."""
        leaf = branch.leaf
        todo = [n for n in leaf.path_from(self.root) if not n.decoded]
        tokens = self.backlog + [n.token for n in todo]
        probs = self._draft_decode(tokens, todo[0].pos - len(self.backlog), branch.seq)
        if probs is None:
            return None
        self.backlog = []
        for n in todo:
            n.decoded = True
        order = np.argpartition(probs, -4)[-4:]
        order = order[np.argsort(-probs[order])]
        added = []
        for rank, token in enumerate(int(t) for t in order):
            p = float(probs[token])
            if rank > 0 and (not siblings or p < self.options.threshold or len(self.branches) >= self.n_seq):
                break
            node = Node(token, leaf, leaf.pos + 1, p, leaf.conf * p)
            leaf.children.append(node)
            self.n_nodes += 1
            added.append(node)
            if rank == 0:
                branch.leaf, branch.length = node, branch.length + 1
                target = branch
            else:  # a new branch: the draft's cells of the path so far, shared
                seq = self.free_seqs.pop()
                mem = self.lib.llama_get_memory(self.draft.ctx)
                self.lib.llama_memory_seq_rm(mem, seq, -1, -1)
                self.lib.llama_memory_seq_cp(mem, branch.seq, seq, -1, leaf.pos + 1)
                target = Branch(seq, node, branch.length)
                self.branches.append(target)
            if self.lib.llama_vocab_is_eog(self.draft.vocab, token) or node.pos + 1 >= self.pos_limit:
                target.done = True
        return added

    def _draft_tree(self, budget: int) -> None:
        while self.n_nodes < budget:
            branch = pace(self.branches, self.n_nodes) if self.options.pacer else round_robin(self.branches)
            if branch is None:
                return
            self._grow(branch, siblings=self.options.tree)
            tree_conf = max(b.leaf.conf for b in self.branches)  # T_c in LLMCad
            if self.options.adaptive and tree_conf < self.alpha:
                return

    # --- the target ---------------------------------------------------------------------------------------------

    def _verify(self) -> tuple[list[int], bool]:
        """One target pass over the tree; the accepted tokens then the target's own, and whether generation ended."""
        lib, t = self.lib, self.target
        # branch by branch, each from the root down: the cells of any root-to-node path then lie in position order,
        # as in a run without speculation (see _bury)
        nodes, seen = [], set()
        for b in self.branches:
            for n in b.leaf.path_from(self.root):
                if id(n) not in seen:
                    seen.add(id(n))
                    nodes.append(n)
        nodes = nodes[:self.n_nodes_max]
        in_pass = set(map(id, nodes))
        seqs = {id(n): [] for n in nodes}
        for i, b in enumerate(self.branches):
            for n in b.leaf.path_from(self.root):
                if id(n) in in_pass:
                    seqs[id(n)].append(i)
        mem = lib.llama_get_memory(t.ctx)
        for i in range(1, len(self.branches)):
            lib.llama_memory_seq_rm(mem, i, -1, -1)
            lib.llama_memory_seq_cp(mem, 0, i, -1, -1)
        for n in nodes:
            n.in_pass = True
        self._tbatch.fill([(n.token, n.pos, seqs[id(n)], True) for n in nodes])
        index = {id(n): i for i, n in enumerate(nodes)}
        self._pass, self._pass_seqs = nodes, seqs
        self.stats.tree_sizes.append(len(nodes))
        self.stats.n_drafted += len(nodes) - 1

        from . import stream

        stall0 = stream.stats().t_stall_s if t.settings.strategy != "mmap" else 0.0
        rc = []
        t0 = time.perf_counter()
        # the per-row kernels a one-token pass uses: with the tiled ones (from 8 tokens) the logits would differ in
        # their last bits from a run without speculation, and near ties would flip (patch 0008)
        native.set_tiled_matmul(0)
        try:
            self._target_pass(rc)
        finally:
            native.set_tiled_matmul(-1)
        t_pass = time.perf_counter() - t0
        self.stats.target_s += t_pass
        if t.settings.strategy != "mmap":
            self.stats.stall_s += stream.stats().t_stall_s - stall0
        if rc[0] != 0:
            raise FlexoffloadError(f"the target's llama_decode failed ({rc[0]}): {t.log.last_error()}")
        self.t_pass = t_pass if self.t_pass is None else 0.5 * (self.t_pass + t_pass)
        self.stats.n_verify += 1

        # the walk: the target's token at each node, down while it is a child the target saw
        node, out, ended = self.root, [], False
        while True:
            token = self._sample(index[id(node)])
            child = next((c for c in node.children if c.in_pass and c.token == token), None)
            out.append(token)
            if lib.llama_vocab_is_eog(t.vocab, token):
                ended = True
                break
            if child is None:
                break
            node = child
        accepted = len(out) - 1
        self.stats.n_accepted += accepted
        self._adapt(node, accepted)
        if not ended:
            self._keep(node, out[-1])
        return out, ended

    def _target_pass(self, rc: list) -> None:
        """The target's llama_decode over the tree (its return code appended to rc), with the draft going on
        meanwhile when pipelining."""
        lib, t = self.lib, self.target
        if not self.options.pipeline:
            rc.append(lib.llama_decode(t.ctx, self._tbatch.batch))
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
        self._target_done = False

        def verify():
            rc.append(lib.llama_decode(t.ctx, self._tbatch.batch))
            self._target_done = True

        worker = threading.Thread(target=verify)
        worker.start()
        lib.llama_set_abort_callback(self.draft.ctx, self._abort, None)
        policy = _idle_thread()
        draft_s = self.stats.draft_s
        try:
            self._draft_during()
        finally:
            lib.llama_set_abort_callback(self.draft.ctx, lib.ggml_abort_callback(), None)  # NULL: no callback
            worker.join()
            lib.llama_set_n_threads(self.draft.ctx, d, d)
            self.stats.pipeline_draft_s += self.stats.draft_s - draft_s
            self.stats.draft_s = draft_s
            _restore_thread(policy)  # last: nothing above is skipped if it fails

    def _draft_during(self) -> None:
        """The speculative generation pipeline: while the target's pass runs, extend the most confident branch."""
        alive = [b for b in self.branches if not b.done]
        if not alive:
            return
        branch = max(alive, key=lambda b: b.leaf.conf)
        n_late = 0
        while not self._target_done and n_late < self.n_nodes_max and not branch.done:
            if self._grow(branch, siblings=False) is None:
                return
            n_late += 1

    def _sample(self, i: int) -> int:
        if self.target.settings.temp <= 0:
            logits = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.target.ctx, i), shape=(self.n_vocab,))
            return int(np.argmax(logits))
        return self.lib.llama_sampler_sample(self.sampler, self.target.ctx, i)

    def _adapt(self, last: Node, accepted: int) -> None:
        """LLMCad eq. 3 over the most matching branch (the longest one through the last accepted node)."""
        if not self.options.adaptive:
            return
        deepest = max((b.leaf for b in self.branches if last in b.leaf.path_from(self.root)),
                      key=lambda n: n.pos, default=last)
        n_all = sum(1 for n in deepest.path_from(self.root)[1:] if n.in_pass)
        if n_all == 0:
            return
        self.alpha = next_alpha(self.alpha, accepted, n_all)

    def _keep(self, last: Node, token: int) -> None:
        """Make the accepted path history in both caches and start the next tree at the target's token (or at the
        node the draft already made for it during the pass, with what it drafted below)."""
        top = self.root.pos
        reuse = next((c for c in last.children if not c.in_pass and c.token == token), None)

        # target: root .. last are in its cache now, in the sequences of the branches through them
        t_seq = next(i for i, b in enumerate(self.branches) if last in b.leaf.path_from(self.root))
        self._bury(last)
        self._move_to_history(self.target.ctx, t_seq, top, last.pos + 1, range(1, len(self.branches)))

        # draft: keep the decoded part of the path (and of the reused chain)
        kept_leaf = last
        if reuse is not None:
            kept_leaf = reuse
            while kept_leaf.children:  # drafted during the pass: a chain
                kept_leaf = kept_leaf.children[0]
        owner = next(b for b in self.branches if kept_leaf in b.leaf.path_from(self.root))
        decoded = [n for n in kept_leaf.path_from(self.root) if n.decoded]
        end = decoded[-1].pos + 1 if decoded else top
        self._move_to_history(self.draft.ctx, owner.seq, top, end, [b.seq for b in self.branches if b.seq != 0])
        self.backlog = [n.token for n in last.path_from(self.root) if not n.decoded]
        self.free_seqs = list(range(self.n_seq - 1, 0, -1))

        if reuse is not None:
            self.stats.n_reused += sum(1 for n in kept_leaf.path_from(reuse))
            self._new_tree(reuse)
            self.branches = [Branch(0, kept_leaf, 0)]
            node, conf = reuse, 1.0
            node.conf = 1.0
            while node.children:  # confidence from the new root
                node = node.children[0]
                conf *= node.prob
                node.conf = conf
                self.n_nodes += 1
        else:
            self._new_tree(Node(token, None, last.pos + 1, 1.0, 1.0))

    def _bury(self, last: Node) -> None:
        """Keep the target's rejected cells that lie before the last accepted one occupied, in a sequence nothing
        attends to. Freed, they would be refilled by the next tokens, whose cells would then come before older
        history; flash attention sums over cells in cell order, in f16, so the logits would differ in their last
        bits from a run without speculation, and a near tie could flip the greedy token. Cells after the last
        accepted one are freed: the next tokens fill them in position order. A speculation run spends these
        cells of its context (-c), at most the tree's rejected nodes per verification."""
        lib = self.lib
        mem = lib.llama_get_memory(self.target.ctx)
        kept = set(map(id, last.path_from(self.root)))
        for n in self._pass:
            if n is last:
                break
            if id(n) not in kept:
                lib.llama_memory_seq_cp(mem, self._pass_seqs[id(n)][0], DEAD_SEQ, n.pos, n.pos + 1)

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

    def _new_tree(self, root: Node) -> None:
        root.parent, root.prob, root.conf, root.in_pass = None, 1.0, 1.0, False
        for c in root.children:
            c.in_pass = False
        self.root = root
        self.branches = [Branch(0, root)]
        self.n_nodes = 1

    def _node_budget(self) -> int:
        """As many nodes as the draft makes in one target pass: drafting longer costs more than verifying."""
        if self.options.max_nodes:
            return min(self.options.max_nodes, self.n_nodes_max)
        if not self.t_pass or not self.t_token:
            return min(16, self.n_nodes_max)
        return max(MIN_NODES, min(self.n_nodes_max, int(self.t_pass / self.t_token)))

    # --- generation ---------------------------------------------------------------------------------------------

    def generate(self, prompt: str, n_predict: int, on_text=None) -> Result:
        lib, t, d = self.lib, self.target, self.draft
        prompt_tokens = t.tokenize(prompt)
        if not prompt_tokens:
            raise FlexoffloadError("the prompt is empty")
        n_ctx = min(t.n_ctx, d.n_ctx)
        if len(prompt_tokens) >= n_ctx:
            raise FlexoffloadError(f"the prompt is {len(prompt_tokens)} tokens, longer than the context of {n_ctx}: raise -c")
        for e in (t, d):
            lib.llama_memory_clear(lib.llama_get_memory(e.ctx), True)
        if t.settings.strategy != "mmap":
            from . import stream

            stream.reset_stats()
        self.stats, self.alpha, self.t_pass, self.t_token = Stats(), self.options.alpha, None, None
        self.pos_limit = n_ctx - 1
        self.sampler = t._sampler()
        self._tbatch = _Batch(lib, max(t.n_batch, self.n_nodes_max), MAX_BRANCHES)
        self._dbatch = _Batch(lib, d.n_batch, 1)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        text, tokens, stop = [], [], "limit"

        def emit(token: int) -> None:
            tokens.append(token)
            chunk = utf8.decode(t.piece(token))
            text.append(chunk)
            if on_text and chunk:
                on_text(chunk)

        try:
            t_start = time.perf_counter()
            self.backlog = []
            if len(prompt_tokens) > 1:  # both models read the prompt before the first token
                self._draft_decode(prompt_tokens[:-1], 0, 0)
            self.backlog = [prompt_tokens[-1]]
            for i in range(0, len(prompt_tokens), t.n_batch):  # the target's prompt passes give the first token
                t_pass = time.perf_counter()
                t._decode(prompt_tokens[i:i + t.n_batch])
            first = lib.llama_sampler_sample(self.sampler, t.ctx, -1)
            t_first = time.perf_counter()
            self.t_pass = t_first - t_pass  # a pass over the target's weights, to size the first tree
            self.free_seqs = list(range(self.n_seq - 1, 0, -1))
            self._new_tree(Node(first, None, len(prompt_tokens), 1.0, 1.0))
            if lib.llama_vocab_is_eog(t.vocab, first):
                stop = "eog"
            else:
                emit(first)
            while stop != "eog" and (n_predict < 0 or len(tokens) < n_predict):
                if self.root.pos + 1 >= self.pos_limit:
                    stop = "context"
                    break
                steps0, draft0 = self.n_nodes, self.stats.draft_s
                budget = min(self._node_budget(), self.pos_limit - self.root.pos)
                self._draft_tree(budget)
                grown = self.n_nodes - steps0
                if grown > 0:
                    per_token = (self.stats.draft_s - draft0) / grown
                    self.t_token = per_token if self.t_token is None else 0.5 * (self.t_token + per_token)
                out, ended = self._verify()
                for token in out:
                    if lib.llama_vocab_is_eog(t.vocab, token):
                        stop = "eog"
                        break
                    emit(token)
                    if n_predict >= 0 and len(tokens) >= n_predict:
                        break
                if ended:
                    stop = "eog"
            t_end = time.perf_counter()
        finally:
            lib.llama_sampler_free(self.sampler)
            self._tbatch.free()
            self._dbatch.free()
        tail = utf8.decode(b"", final=True)
        if tail:
            text.append(tail)
            if on_text:
                on_text(tail)
        del tokens[n_predict if n_predict >= 0 else len(tokens):]
        n_gen = len(tokens)
        timings = self.stats.to_dict(n_gen)
        if t.settings.strategy != "mmap":
            from . import stream

            st = stream.stats()
            timings.update(stream_bytes_read=st.bytes_read, stream_passes=st.n_passes, stream_rereads=st.n_rereads)
        decode_s = t_end - t_first
        return Result(
            text="".join(text), tokens=tokens, n_prompt=len(prompt_tokens), n_gen=n_gen,
            ttft_s=t_first - t_start, prompt_tok_s=len(prompt_tokens) / max(t_first - t_start, 1e-9),
            decode_tok_s=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
            load_s=t.load_s + d.load_s, strategy=t.settings.strategy + "+tree", stop=stop, timings=timings)


def run(target_path, settings, draft_path, options: Options, prompt: str, n_predict: int, on_text=None) -> Result:
    """Load the target (as settings say: streamed by its plan, or mmap) and the draft (resident), and generate."""
    with Engine(draft_path, draft_settings(settings, load(draft_path))) as draft, \
            Engine(target_path, target_settings(settings, options.max_nodes)) as target:
        return Speculator(target, draft, options).generate(prompt, n_predict, on_text)


def target_settings(settings, max_nodes: int | None = None):
    """The target's context: a logits row per tree node, a sequence per branch and one for rejected cells."""
    from dataclasses import replace

    return replace(settings, n_outputs=max(max_nodes or MAX_NODES, MAX_BRANCHES + 1), n_seq_max=MAX_BRANCHES + 1)


def draft_by_rows(draft: Model) -> list[str]:
    """The draft's tensors read by rows, not kept: a token_embd used only for lookups (the draft has an output
    matrix of its own) costs one small read a draft token, and its memory goes to the target (89 MiB of the
    0.5B Qwen's 537)."""
    return [t.name for t in draft.tensors if reads_rows(draft, t) and not is_small(t)]


def draft_settings(settings, draft: Model):
    """The draft's: every tensor read once into memory but those read by rows (draft_by_rows); one output per
    step, but llama.cpp reserves at least one per sequence."""
    from dataclasses import replace

    patterns = override_patterns(draft_by_rows(draft), [t.name for t in draft.tensors])
    return replace(settings, strategy="stream", streamed_patterns=tuple(patterns), n_outputs=MAX_BRANCHES,
                   n_seq_max=MAX_BRANCHES)
