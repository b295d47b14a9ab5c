"""What one speculating generate call keeps between its steps (_Call), and the llama_batch that carries a tree or a
draft's path (_Batch).

Apart from speculate.py because every part of a call reads and writes it: the drafting (grow.py), the target's
pass (verify.py) and the KV bookkeeping (kvcache.py), none of which imports another for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexoffload import FlexoffloadError
from flexoffload.speculation.tree import Node, Stats, Tree


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
    pass_end: int = 0  # this pass drafts no node at or past it: pos_limit, or past the last token asked for
    stats: Stats = field(default_factory=Stats)
    backlog: list[int] = field(default_factory=list)  # tokens the draft has yet to decode before the tree's nodes
    free_seqs: list[int] = field(default_factory=list)  # the draft's sequences no branch holds
    t_pass: float | None = None  # a target pass, seconds (smoothed)
    t_token: float | None = None  # a draft token, seconds (smoothed)
    pass_nodes: list[Node] = field(default_factory=list)  # the last pass's nodes, in batch order
    pass_seqs: dict[int, list[int]] = field(default_factory=dict)  # and the branches each lies on
    history: list[int] = field(default_factory=list)  # prompt and output, the tree's root last
    control: object = None  # the measured decision (control.Controller), where it sizes the draft's trees
