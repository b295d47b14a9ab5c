"""The spare rows of a draft's cut head (FR-Spec, gguf/headcut.py) pointed at the prompt's tokens the head lacks.

A head cut to the tokens a corpus uses most lacks a prompt's own words (HumanEval/81's `_grade`), and a draft that
cannot propose a token breaks its chain there: on HumanEval/81 the draft cut to 32,768 tokens made 4.6 tokens a pass
where the whole head made 10.7. Before each prompt, the tokens it holds that the head lacks take the spare rows
(round robin: the rows pointed longest ago, not at the prompt's tokens), their weights read as stored from the file
the head was cut from, so the draft's logits for them are the whole head's (patch 0032, llama_head_set_rows). A
token the target outputs that the head lacks takes one as well (an answer's own words recur), never one the
prompt's tokens hold.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np

from flexoffload import FlexoffloadError
from flexoffload.gguf import headcut
from flexoffload.gguf.model import load
from flexoffload.native import head as native_head


class Spare:
    """A loaded draft's cut head and the tokens its spare rows hold."""

    def __init__(self, model, path: str | Path, source: Path, n_spare: int):
        cut, src = load(path), load(source)
        ids = next(t for t in cut.tensors if t.name == headcut.IDS)
        cut_head = next(t for t in cut.tensors if t.name == headcut.HEAD)
        self.whole = headcut.head_tensor(src)
        if (self.whole is None or self.whole.type != cut_head.type or self.whole.shape[0] != cut_head.shape[0]
                or src.n_vocab != cut.n_vocab):
            raise ValueError(f"{source.name} is not the file {Path(path).name} was cut from")
        with open(path, "rb") as f:
            f.seek(ids.offset)
            rows = np.frombuffer(f.read(ids.n_bytes), dtype=np.int32)
        self.model, self.source = model, source
        self.row_bytes = self.whole.n_bytes // self.whole.shape[-1]
        self.where = {int(t): i for i, t in enumerate(rows)}  # token -> its row
        self.first = len(rows) - n_spare
        self.tokens = [int(t) for t in rows[self.first:]]  # what each spare row holds
        self.next = 0  # the spare row pointed longest ago

    def admit(self, tokens: list[int], keep: set[int] = frozenset()) -> int:
        """Point spare rows at the tokens the head lacks, the most frequent first, taking the rows pointed longest
        ago whose tokens neither these nor keep hold: how many were pointed."""
        counts = Counter(t for t in tokens if t not in self.where)
        if not counts:
            return 0
        wanted, n = set(tokens) | keep, len(self.tokens)
        free = [i for i in ((self.next + k) % n for k in range(n)) if self.tokens[i] not in wanted]
        lacking = [t for t, _ in counts.most_common(len(free))]
        if not lacking:
            return 0
        fd = os.open(self.source, os.O_RDONLY)
        try:
            for done, (token, i) in enumerate(zip(lacking, free)):
                data = os.pread(fd, self.row_bytes, self.whole.offset + token * self.row_bytes)
                if len(data) != self.row_bytes or not native_head.set_rows(self.model, self.first + i, [token], data):
                    return done
                del self.where[self.tokens[i]]
                self.where[token], self.tokens[i] = self.first + i, token
                self.next = (i + 1) % n
        finally:
            os.close(fd)
        return len(lacking)


def spare(draft, path: str | Path, notes: list[str] | None = None) -> Spare | None:
    """The draft's spare rows where its head is cut with some and the file it was cut from is at hand (None, with a
    note, where that file is gone or changed: the draft then proposes from the frequent tokens alone). The draft's
    weights must be writable: loaded into memory, not mapped."""
    if draft.settings.strategy == "mmap" or native_head.n_rows(draft.model) <= 0:
        return None
    info = headcut.source(path)
    if info is None or info[1] <= 0:
        return None
    try:
        return Spare(draft.model, path, *info)
    except (FlexoffloadError, OSError, ValueError, StopIteration) as e:
        if notes is not None:
            notes.append(f"flexoffload: the draft's cut head proposes its frequent tokens alone ({e})")
        return None
