"""The tree of token-tree speculation (LLMCad), without llama.cpp: nodes and branches, the branch pacer, the adaptive
fallback threshold, the order the target verifies a tree in and the walk down it, and what speculation is predicted
to yield. speculate.py runs it on the two models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

THRESHOLD = 0.3  # a candidate this likely opens a branch (LLMCad); where it starts when it adapts (next_threshold)
THRESHOLD_RANGE = (0.1, 0.9)  # where the adaptive threshold moves: 0.9 leaves a near chain, 0.1 a bushy tree
ALPHA = 0.01  # starting fallback threshold on the tree-cumulative confidence (LLMCad)
MAX_BRANCHES = 16  # sequences per model: branches alive in one tree
MAX_NODES = 48  # cap on the tree's node budget (the target's batch, and its logits rows)
MIN_NODES = 4
# What verifying costs beyond a one-token pass: each further node of the tree, a share of the target's compute per
# token with every weight in memory. Verification uses the one-token kernels (patch 0009), so the nodes are near
# linear in compute: 17-token tree passes took 0.51-0.64 s, 9-token ones 0.32-0.45 s, against 0.045 s for one token
# (results/tree_mask_overhead.csv, all weights in memory): (0.58 - 0.33) / 8 / 0.045 = 0.7 a node.
VERIFY_SHARE = 0.7


@dataclass
class Options:
    tree: bool = True  # False: a linear chain (only the draft's top token)
    pacer: bool = True  # False: branches grow in turn (round robin)
    adaptive: bool = True  # False: verify only when the tree reaches its node budget
    adaptive_split: bool = True  # False: the branch threshold stays where it is given (next_threshold)
    pipeline: bool = False  # draft on while the target verifies (measured within noise on 2 cores: off by default)
    tiled: bool = False  # verify with the tiled kernels from 8 nodes, as llama.cpp does: not bit-exact (ablation)
    threshold: float = THRESHOLD
    alpha: float = ALPHA
    max_nodes: int | None = None  # node budget; None: from the measured target pass and draft token times
    node_s: float = 0.0  # what a node adds to the target's pass (VERIFY_SHARE of its compute a token); 0: unknown
    hidden_nodes: int = 0  # nodes past the root whose compute hides under a streamed pass's reads: they cost nothing
    # a draft model's trees: sized by what the run measures (control.py), or by LLMCad's confidence rules
    control: str = "measured"
    pass_s: float = 0.0  # the plan's one-token pass, seconds (0: unknown), where the measured line starts
    step_s: float = 0.0  # a draft step's predicted seconds (0: unknown until one is measured)
    always: bool = False  # never turn the draft off (--draft-always)
    history: dict | None = None  # the stored measurements the run starts from (speccontrol.Measured.to_json)
    history_path: str | None = None  # where the run's measurements are stored when it ends (None: not kept)
    history_kind: str = ""  # the prompt's kind they are stored under (code, text)
    # a benchmark's: (rows, kept, steps) passes of a real run replayed on this target, not drafted (replay.py)
    replay: tuple = ()

    def __post_init__(self):
        self.replay = tuple(tuple(p) for p in self.replay)  # JSON gives lists (a Prepared read back)


class Node:
    __slots__ = ("token", "parent", "pos", "prob", "conf", "children", "decoded", "in_pass", "origins", "est")

    def __init__(self, token: int, parent: "Node | None", pos: int, prob: float, conf: float):
        self.token, self.parent, self.pos, self.prob, self.conf = token, parent, pos, prob, conf
        self.children: list[Node] = []
        self.decoded = False  # in the draft's KV cache
        self.in_pass = False  # part of the target pass being verified
        self.origins: list = []  # (drafter, kind) of the free drafters that proposed it (drafters.merge)
        self.est = 1.0  # the chance the target accepts its path, by the measured rates (control.py)

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
    n_emitted: int = 0  # tokens the verifications gave (accepted and the target's own)
    tree_sizes: list[int] = field(default_factory=list)
    draft_s: float = 0.0  # drafting between target passes
    pipeline_draft_s: float = 0.0  # drafting during target passes (the pipeline), not on the critical path
    target_s: float = 0.0
    stall_s: float = 0.0
    by_drafter: dict[str, list[int]] = field(default_factory=dict)  # drafter -> [nodes verified, accepted]
    # each pass: [rows verified, tokens emitted, draft steps, draft s, target s, other s] (the breakdown)
    passes: list[list] = field(default_factory=list)

    def to_dict(self, n_gen: int) -> dict:
        sizes = self.tree_sizes or [0]
        return {
            "n_verify": self.n_verify,
            "tokens_per_pass": n_gen / self.n_verify if self.n_verify else 0.0,
            "acceptance_rate": self.n_accepted / self.n_drafted if self.n_drafted else 0.0,
            "n_drafted": self.n_drafted, "n_accepted": self.n_accepted, "n_reused": self.n_reused,
            "tree_size_mean": sum(sizes) / len(sizes), "tree_size_max": int(max(sizes)),
            "draft_s": self.draft_s, "pipeline_draft_s": self.pipeline_draft_s,
            "target_compute_s": max(self.target_s - self.stall_s, 0.0),
            "io_stall_s": self.stall_s, "target_s": self.target_s,
            "passes": [[round(x, 4) if isinstance(x, float) else x for x in p] for p in self.passes],
            "drafters": {name: {"n_drafted": n, "n_accepted": a, "acceptance_rate": a / n if n else 0.0}
                         for name, (n, a) in self.by_drafter.items()},
        }


def node_costs(pass_s: float, token_s: float) -> tuple[float, int]:
    """What a node past the root adds to a target pass (VERIFY_SHARE of the target's compute a token, token_s), and
    how many nodes cost nothing: a streamed one-token pass of pass_s waits for its reads, and the compute of the
    nodes that fits in that wait is hidden in it (pass_s 0: unknown, none)."""
    node_s = VERIFY_SHARE * token_s
    return node_s, int(max(pass_s - token_s, 0) / node_s) if pass_s and node_s else 0


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


def next_threshold(threshold: float, took_branch: bool, had_branch: bool, all_accepted: bool) -> float:
    """The branch threshold after a verification, moved by what the target accepted. Branches (a draft candidate
    past the threshold beside the top one) cost nodes the main chain could have used to go deeper: a pass that had
    some and accepted through none raises it (code, where the draft's top token is usually right, goes to a near
    chain); a pass whose accepted path went through a side branch, or that rejected part of a chain with no branch
    to fall back on, lowers it (prose, where the draft is often unsure, gets a bushier tree)."""
    lo, hi = THRESHOLD_RANGE
    if took_branch or (not had_branch and not all_accepted):
        return max(lo, threshold * 0.8)
    if had_branch:
        return min(hi, threshold * 1.25)
    return threshold


def next_alpha(alpha: float, n_correct: int, n_all: int) -> float:
    """LLMCad eq. 3: halve the fallback threshold when the most matching branch was all correct, else set it to
    the branch's error fraction."""
    return alpha * 0.5 if n_correct >= n_all else (n_all - n_correct) / n_all


class Tree:
    """One draft tree: its root (the target's last token), its branches (a draft sequence each), its node count."""

    def __init__(self, root: Node, leaf: Node | None = None):
        """A tree at root; leaf: a chain below root drafted already (during the target's last pass), made the
        first branch with its confidences counted from the new root."""
        root.parent, root.prob, root.conf, root.in_pass, root.est = None, 1.0, 1.0, False, 1.0
        for c in root.children:
            c.in_pass = False
        self.root, self.branches, self.n_nodes = root, [Branch(0, leaf or root)], 1
        node = root
        while node is not (leaf or root):
            node = node.children[0]
            node.conf = node.parent.conf * node.prob
            node.est = node.parent.est * node.prob  # drafted during a pass: its own confidence stands in
            self.n_nodes += 1

    def next_branch(self, pacer: bool) -> Branch | None:
        return pace(self.branches, self.n_nodes) if pacer else round_robin(self.branches)

    def confidence(self) -> float:
        """T_c in LLMCad: the most confident branch's cumulative confidence."""
        return max(b.leaf.conf for b in self.branches)

    def add(self, leaf: Node, token: int, prob: float) -> Node:
        node = Node(token, leaf, leaf.pos + 1, prob, leaf.conf * prob)
        leaf.children.append(node)
        self.n_nodes += 1
        return node

    def path(self, node: Node) -> list[Node]:
        return node.path_from(self.root)

    def owner(self, node: Node) -> int:
        """The index of the first branch whose path goes through node."""
        return next(i for i, b in enumerate(self.branches) if node in self.path(b.leaf))

    def for_pass(self, n_max: int) -> tuple[list[Node], dict[int, list[int]]]:
        """The nodes one target pass verifies (at most n_max), marked in_pass, and the branches each lies on (its
        sequences in the target's cache). Branch by branch, each from the root down, so the cells of any
        root-to-node path lie in position order, as in a run without speculation."""
        nodes, seen = [], set()
        for b in self.branches:
            for n in self.path(b.leaf):
                if id(n) not in seen:
                    seen.add(id(n))
                    nodes.append(n)
        nodes = nodes[:n_max]
        seqs = {id(n): [] for n in nodes}
        for i, b in enumerate(self.branches):
            for n in self.path(b.leaf):
                if id(n) in seqs:
                    seqs[id(n)].append(i)
        for n in nodes:
            n.in_pass = True
        return nodes, seqs

    def walk(self, nodes: list[Node], sample: Callable[[int], int],
             is_eog: Callable[[int], bool]) -> tuple[list[int], Node, bool]:
        """Down the verified tree by the target's own tokens: at each node sample(i) (i: its row in the pass) picks
        the target's token, and the walk goes on while that token is a child the target verified. The tokens (the
        accepted ones, then the target's own), the last accepted node, and whether generation ended."""
        row = {id(n): i for i, n in enumerate(nodes)}
        node, out = self.root, []
        while True:
            token = sample(row[id(node)])
            out.append(token)
            if is_eog(token):
                return out, node, True
            child = next((c for c in node.children if c.in_pass and c.token == token), None)
            if child is None:
                return out, node, False
            node = child

    def took_branch(self, last: Node) -> bool:
        """Whether the accepted path (down to last) went through a side branch: a node not its parent's top
        candidate (the first child the draft added)."""
        return any(n is not n.parent.children[0] for n in self.path(last)[1:])

    def had_branch(self, nodes: list[Node]) -> bool:
        """Whether a pass's nodes hold a side branch (the root aside)."""
        return any(n is not self.root and n is not n.parent.children[0] for n in nodes)

    def matched(self, last: Node, branches: list[Branch] | None = None) -> int:
        """The nodes the target checked on the most matching branch (the deepest through last; of branches, by
        default all), root excluded: LLMCad eq. 3's n_all."""
        deepest = max((b.leaf for b in (self.branches if branches is None else branches)
                       if last in self.path(b.leaf)), key=lambda n: n.pos, default=last)
        return sum(1 for n in self.path(deepest)[1:] if n.in_pass)
