"""Drafters that need no model in memory: guesses for the target's next tokens from the context (n-grams) and from
the target's own past predictions (Token Recycling), behind one interface, merged into one token tree.

A drafter proposes branches: token sequences that continue the history (prompt, output, and the tree's root, the
target's last token), each token with a kind (what the drafter knows it by: an n-gram's length, a top-k rank). The
chance that a token of a kind is accepted once its parent was is learned from every verification (`judge`), from a
prior; a node's confidence is the product of those chances down its path. `merge` takes the most confident nodes of
all proposals under the node budget and the branch limit. After the target's pass each drafter is told what it
verified: the acceptances (`judge`) and, for a drafter that wants them, the target's logits after every node
(`learn`). Pure Python and numpy: speculate.py runs them against the target.
"""

from __future__ import annotations

import heapq
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from flexoffload.defaults import MAP_K_SIZE, NGRAM_SIZES

NGRAM_LENGTH = 16  # tokens a matched continuation proposes at most
NGRAM_MATCHES = 4  # distinct continuations (branches) an n-gram lookup proposes at most
RECYCLE_K = 8  # Token Recycling: candidates kept per token (the table is n_vocab x k int32)
LEARN_ROWS = 4  # logits rows a learner is given at once (verify.py): what it holds while it learns is counted


@dataclass
class Proposal:
    """A branch a drafter proposes: tokens that follow the history, each with its kind."""
    tokens: list[int]
    kinds: list[int]
    source: str


class Drafter:
    """One source of guesses. name: as --spec-type spells it; table_bytes: the memory it keeps (counted in the plan)."""
    name = ""
    wants_logits = False  # learn() is given the target's logits rows
    prior: dict[int, tuple[float, float]] = {}  # kind -> (accepted, reached) before any verification
    default_prior = (1.0, 2.0)

    def __init__(self):
        self.counts: dict[int, list[float]] = {}

    @property
    def table_bytes(self) -> int:
        return 0

    def reset(self) -> None:
        """A new generation: forget the history (learned rates and tables stay)."""

    def propose(self, history: list[int], n_max: int) -> list[Proposal]:
        """Branches continuing history (it ends with the tree's root); at most n_max tokens in all."""
        raise NotImplementedError

    def rate(self, kind: int) -> float:
        """The chance a token of this kind is accepted, given its parent was."""
        hit, seen = self.counts.get(kind) or self.prior.get(kind, self.default_prior)
        return hit / seen

    def judge(self, kind: int, accepted: bool) -> None:
        """A verified token of this kind whose parent the target accepted: accepted or not."""
        c = self.counts.setdefault(kind, list(self.prior.get(kind, self.default_prior)))
        c[0] += accepted
        c[1] += 1

    def learn(self, tokens: list[int], logits: np.ndarray) -> None:
        """The target's logits (a row per token) after each token of a pass, in the pass's context."""

    def save(self) -> None:
        """Keep what was learned for the next run (a drafter with a store; others forget)."""


class NgramSimple(Drafter):
    """Prompt lookup (llama.cpp's ngram-simple, with a tree): the last n tokens (n = 3, 2, 1) where they occurred
    before in the history, and what followed them there; the most recent distinct continuations of the longest key
    that matches become branches (shorter keys fill in when the longer find fewer). Kind: the key's length."""
    name = "ngram-simple"
    prior = {3: (3.0, 5.0), 2: (2.0, 5.0), 1: (1.0, 5.0)}

    def __init__(self, sizes=NGRAM_SIZES, length: int = NGRAM_LENGTH, matches: int = NGRAM_MATCHES):
        super().__init__()
        self.sizes, self.length, self.matches = tuple(sorted(sizes, reverse=True)), length, matches
        self.reset()

    def reset(self) -> None:
        self.index: dict[tuple[int, ...], list[int]] = {}  # key -> the positions just after its occurrences
        self.n_indexed = 0

    def _index(self, history: list[int]) -> None:
        for end in range(self.n_indexed + 1, len(history) + 1):
            for n in self.sizes:
                if end >= n:
                    self.index.setdefault(tuple(history[end - n:end]), []).append(end)
        self.n_indexed = len(history)

    def propose(self, history: list[int], n_max: int) -> list[Proposal]:
        self._index(history)
        out, firsts, left = [], set(), n_max
        for n in self.sizes:
            if len(history) < n:
                continue
            for end in reversed(self.index.get(tuple(history[-n:]), [])):
                if len(out) >= self.matches or left <= 0:
                    return out
                tokens = history[end:end + min(self.length, left)]
                if not tokens or tokens[0] in firsts:  # the suffix itself, or a continuation already proposed
                    continue
                firsts.add(tokens[0])
                out.append(Proposal(tokens, [n] * len(tokens), self.name))
                left -= len(tokens)
        return out


class NgramMapK(Drafter):
    """llama.cpp's ngram-map-k, in a tree: the key (the last MAP_K_SIZE tokens) in a map of the history's n-grams,
    and the continuation that followed it most often (by its first token; ties to the most recent), one branch.
    Kind 0."""
    name = "ngram-map-k"
    prior = {0: (3.0, 5.0)}

    def __init__(self, size: int = MAP_K_SIZE, length: int = NGRAM_LENGTH, min_hits: int = 1):
        super().__init__()
        self.size, self.length, self.min_hits = size, length, min_hits
        self.reset()

    def reset(self) -> None:
        self.index: dict[tuple[int, ...], list[int]] = {}
        self.n_indexed = 0

    def propose(self, history: list[int], n_max: int) -> list[Proposal]:
        n = self.size
        for end in range(max(self.n_indexed + 1, n), len(history) + 1):
            self.index.setdefault(tuple(history[end - n:end]), []).append(end)
        self.n_indexed = len(history)
        if len(history) < n:
            return []
        ends = [e for e in self.index.get(tuple(history[-n:]), []) if e < len(history)]
        if not ends:
            return []
        votes: dict[int, int] = {}
        for e in ends:
            votes[history[e]] = votes.get(history[e], 0) + 1
        best = max(votes, key=lambda t: (votes[t], max(e for e in ends if history[e] == t)))
        if votes[best] < self.min_hits:
            return []
        end = max(e for e in ends if history[e] == best)
        tokens = history[end:end + min(self.length, n_max)]
        return [Proposal(tokens, [0] * len(tokens), self.name)] if tokens and n_max > 0 else []


class Recycle(Drafter):
    """Token Recycling (arXiv 2408.08696): a table of the target's top-k next tokens after each token, overwritten
    from the logits of every verification pass (every row the target computed), drawn as a tree from the history's
    last token: best first through the table, each candidate's chance that of its rank (learned), under the node
    budget. Rows the target has not computed yet start from the prompt's own successors. Kind: the rank.

    With a store (a file), the table and the learned rates outlive the run, as the paper keeps its table across
    queries: a run starts from every earlier run's predictions of the same model. A store that does not fit (another
    model, another k) or cannot be read is ignored."""
    name = "recycle"
    wants_logits = True
    prior = {0: (2.0, 4.0), 1: (1.0, 6.0), 2: (1.0, 10.0)}
    default_prior = (1.0, 20.0)

    def __init__(self, n_vocab: int, k: int = RECYCLE_K, max_leaves: int = 16, store: Path | None = None):
        super().__init__()
        self.k, self.max_leaves, self.store = k, max_leaves, store
        self.table = np.full((n_vocab, k), -1, dtype=np.int32)
        self.n_seeded = 0
        if store is not None and store.is_file():
            self._load(store)

    def _load(self, store: Path) -> None:
        try:
            with np.load(store) as f:
                table, kinds, counts = f["table"], f["kinds"], f["counts"]
        except (OSError, ValueError, KeyError):
            return
        if table.shape == self.table.shape and table.dtype == self.table.dtype and counts.shape == (len(kinds), 2):
            self.table = table
            self.counts = {int(k): [float(a), float(b)] for k, (a, b) in zip(kinds, counts)}

    def save(self) -> None:
        if self.store is None:
            return
        kinds = np.array(sorted(self.counts), dtype=np.int64)
        counts = np.array([self.counts[int(k)] for k in kinds], dtype=np.float64).reshape(-1, 2)
        self.store.parent.mkdir(parents=True, exist_ok=True)
        part = self.store.with_name(f"{self.store.name}.{os.getpid()}.part")
        with open(part, "wb") as f:  # whole or not at all: a part file renamed over the store
            np.savez(f, table=self.table, kinds=kinds, counts=counts)
        part.replace(self.store)

    @property
    def table_bytes(self) -> int:
        return self.table.nbytes

    def reset(self) -> None:
        self.n_seeded = 0

    def _seed(self, history: list[int]) -> None:
        """An empty row takes the successor the history shows (the target overwrites it once it computes one)."""
        for i in range(max(self.n_seeded, 1), len(history)):
            row = self.table[history[i - 1]]
            if row[0] < 0:
                row[0] = history[i]
        self.n_seeded = len(history)

    def learn(self, tokens: list[int], logits: np.ndarray) -> None:
        k = self.k
        top = np.argpartition(logits, -k, axis=1)[:, -k:]
        order = np.argsort(-np.take_along_axis(logits, top, axis=1), axis=1)
        self.table[np.asarray(tokens)] = np.take_along_axis(top, order, axis=1)

    def propose(self, history: list[int], n_max: int) -> list[Proposal]:
        self._seed(history)
        # best first: (-confidence, tiebreak, token, path tokens, path kinds)
        heap, n, leaves, count = [], 0, [], 0
        root = history[-1]

        def push(token, conf, tokens, kinds):
            nonlocal count
            for rank, child in enumerate(self.table[token]):
                if child < 0:
                    break
                c = conf * self.rate(rank)
                heapq.heappush(heap, (-c, count, int(child), tokens + [int(child)], kinds + [rank]))
                count += 1

        push(root, 1.0, [], [])
        taken: list[tuple[list[int], list[int]]] = []
        while heap and n < n_max:
            neg, _, token, tokens, kinds = heapq.heappop(heap)
            taken.append((tokens, kinds))
            n += 1
            push(token, -neg, tokens, kinds)
        # the leaves of the taken nodes become branches (a taken node's path is a prefix of a longer taken path or
        # a leaf), most confident first, within the branch limit
        paths = {tuple(t) for t, _ in taken}
        for tokens, kinds in taken:
            if not any(tuple(tokens) + (c,) in paths for c in self.table[tokens[-1]] if c >= 0):
                leaves.append(Proposal(tokens, kinds, self.name))
        return leaves[:self.max_leaves]


DRAFTERS = ("ngram-simple", "ngram-map-k", "recycle")  # the free ones; `model` is the draft model (-md)
SPEC_TYPES = DRAFTERS + ("model", "auto")


def make(names, n_vocab: int, store: Path | None = None) -> list[Drafter]:
    """The free drafters named (DRAFTERS), in order; store: where Token Recycling's table persists (None: not)."""
    kinds = {"ngram-simple": NgramSimple, "ngram-map-k": NgramMapK}
    return [Recycle(n_vocab, store=store) if n == "recycle" else kinds[n]() for n in names if n in DRAFTERS]


def table_bytes(names, n_vocab: int) -> int:
    """The memory the named drafters take (the plan counts it): Token Recycling's table, and what learning from a
    pass holds while it runs (LEARN_ROWS rows of logits copied, 4 bytes a logit, and their top-k's indices, 8)."""
    return n_vocab * (RECYCLE_K * 4 + LEARN_ROWS * 12) if "recycle" in names else 0


@dataclass
class Pick:
    """A node merge chose: its token, its chance given its parent, and the drafters (and kinds) that proposed it."""
    token: int
    prob: float
    origins: list[tuple[Drafter, int]] = field(default_factory=list)


HIDDEN_FLOOR = 0.02  # a node whose compute hides in the pass (n_hidden) is not worth a row below this confidence


def merge(proposals: list[tuple[Drafter, Proposal]], n_nodes: int, n_leaves: int,
          min_conf: float = 0.0, n_hidden: int = 0) -> list[list[Pick]]:
    """The branches to verify: the proposals merged into one trie (a token proposed twice is one node, with the
    higher chance), then its most confident nodes, a node only with its parent, while confidence (the product of
    chances down the path) stays at least min_conf (HIDDEN_FLOOR for the first n_hidden nodes: their compute hides
    in the pass's reads), at most n_nodes nodes and n_leaves leaves. Root-to-leaf paths, most confident first."""
    trie: dict[tuple[int, ...], Pick] = {}
    for drafter, p in proposals:
        path: tuple[int, ...] = ()
        for token, kind in zip(p.tokens, p.kinds):
            path += (token,)
            prob = drafter.rate(kind)
            pick = trie.get(path)
            if pick is None:
                pick = trie[path] = Pick(token, prob)
            pick.prob = max(pick.prob, prob)
            pick.origins.append((drafter, kind))
    conf: dict[tuple[int, ...], float] = {}
    for path in sorted(trie, key=len):
        conf[path] = conf.get(path[:-1], 1.0) * trie[path].prob
    chosen: set[tuple[int, ...]] = set()
    leaves: set[tuple[int, ...]] = set()
    # parents first: a child is never more confident than its parent, and ties go to the shorter path
    for path in sorted(trie, key=lambda q: (-conf[q], len(q))):
        if len(chosen) >= n_nodes or conf[path] < (min_conf if len(chosen) >= n_hidden else HIDDEN_FLOOR):
            break
        parent = path[:-1]
        if parent and parent not in chosen:
            continue
        if parent not in leaves and len(leaves) >= n_leaves:
            continue  # a new leaf beside the others: no sequence left for it
        chosen.add(path)
        leaves.discard(parent)
        leaves.add(path)
    ordered = sorted(leaves, key=lambda q: -conf[q])
    return [[trie[q[:i]] for i in range(1, len(q) + 1)] for q in ordered]
