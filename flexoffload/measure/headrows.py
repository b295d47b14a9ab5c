"""Which tokens a draft's cut head keeps (FR-Spec, arXiv 2502.14856): the ones a corpus uses most, counted with the
draft's own tokenizer, and the cut copy itself, made once and cached (gguf/headcut.py writes it).

FR-Spec counts a large web corpus; no such corpus can be fetched here, so the count is taken over what every Python
installation holds: the standard library's sources (code, and English in their docstrings and comments, with
pydoc's topic texts), read in a fixed order up to CORPUS_BYTES. No benchmark prompt is in it. Tokens the corpus never
shows follow in id order (a BPE vocabulary numbers its tokens in merge order, roughly by frequency), and every token
that is not a normal piece (the end-of-generation and chat markers) is kept whatever its count. The last SPARE rows
(the least used kept) are spare: a run points them at its prompt's tokens the head lacks (gguf/headcut.py).
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path

import numpy as np

from flexoffload.defaults import cache_dir, file_key
from flexoffload.gguf import headcut
from flexoffload.gguf.model import Model
from flexoffload.runtime.engine import tokenize, vocabulary

ROWS = 32768  # FR-Spec's head for Llama-3's 128k vocabulary; 22 % of Qwen2.5's 151,936
SPARE = 1024  # of them, the least used, which a run points at its prompt's tokens the rest lack (speculation/head.py)
CORPUS_BYTES = 8 << 20


def corpus_files() -> list[Path]:
    """The corpus's files in their fixed order: the standard library's sources, tests and site-packages left out."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if not {"test", "tests", "site-packages", "idle_test"} & set(p.relative_to(stdlib).parts))
    return files


def counts(model: Model) -> np.ndarray:
    """How often the corpus uses each token of the model's vocabulary (cached by the file, as its tokenizer)."""
    out = cache_dir() / "heads" / f"{file_key(model.path)}-counts.npy"
    if out.is_file():
        return np.load(out)
    n = np.zeros(model.n_vocab, dtype=np.int64)
    left = CORPUS_BYTES
    with vocabulary(str(model.path)) as (lib, vocab):
        for f in corpus_files():
            if left <= 0:
                break
            text = f.read_text(encoding="utf-8", errors="replace")[:left]
            left -= len(text)
            n += np.bincount(tokenize(lib, vocab, text, add_special=False), minlength=model.n_vocab)[:model.n_vocab]
        special = [t for t in range(model.n_vocab)
                   if lib.llama_vocab_is_eog(vocab, t) or lib.llama_vocab_is_control(vocab, t)]
    n[special] = n.max() + 1  # kept whatever the corpus says
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part.npy")
    np.save(tmp, n)
    tmp.replace(out)
    return n


def frequent(model: Model, rows: int = ROWS) -> np.ndarray:
    """The rows token ids the head keeps, most used first, ties (and the unseen) by id."""
    n = counts(model)
    return np.lexsort((np.arange(n.size), -n))[:rows]  # the last key sorts first: count descending, then id


def path(model: Model, rows: int = ROWS) -> Path:
    """Where the model's copy with its head cut to rows tokens lives in the cache: by the Python whose standard
    library was counted too, since another Python's keeps other tokens."""
    python = "py{}{}".format(*sys.version_info[:2])
    return cache_dir() / "heads" / f"{file_key(model.path)}-head{rows}-spare{min(SPARE, rows // 4)}-{python}.gguf"


def cut(model: Model, rows: int = ROWS) -> Path:
    """The model's copy with its head cut to its rows most frequent tokens, made once, then cached."""
    out = path(model, rows)
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        headcut.write(model.path, out, frequent(model, rows), spare=min(SPARE, rows // 4))
    return out
