"""A draft's output head cut to the frequent tokens (FR-Spec): the file (gguf/headcut.py), its logits as patch 0032
loads it (the whole head's at its tokens, -inf elsewhere), the rows chosen (measure/headrows.py), and -md running
such a copy, made once and cached, losslessly."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from flexoffload import FlexoffloadError
from flexoffload.gguf import headcut, synth
from flexoffload.gguf.model import load
from flexoffload.runtime import engine
from flexoffload.speculation import speculate

from conftest import cli


def _tensors(path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("qtype", ["Q8_0", "F32"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_cut_head_keeps_its_rows_names_their_tokens_and_copies_the_rest(tmp_path, qtype, tied):
    shape = replace(synth.SHAPES["qwen2-tiny"], tied_embeddings=tied)
    full = synth.write(tmp_path / "full.gguf", shape, qtype=qtype, seed=5)
    kept = np.array([300, 3, 17, 250, 5])  # in the order given (most used first)
    cut = headcut.write(full, tmp_path / "cut.gguf", kept, spare=2)
    before, after = _tensors(full), _tensors(cut)
    head = before["token_embd.weight" if tied else "output.weight"]
    assert np.array_equal(np.asarray(after["output.weight"].data), np.asarray(head.data)[kept])
    assert after["output.weight"].tensor_type == head.tensor_type
    assert np.array_equal(np.asarray(after["output_ids.weight"].data), kept)
    assert set(after) == set(before) | {"output.weight", "output_ids.weight"}
    for name, t in before.items():
        if name != "output.weight":
            assert np.array_equal(np.asarray(after[name].data), np.asarray(t.data)), name
    model = load(cut)
    assert model.n_vocab == shape.n_vocab and not model.tied_embeddings and headcut.rows(model) == 5
    assert headcut.source(cut) == (full.resolve(), 2) and headcut.source(full) is None
    with pytest.raises(FlexoffloadError, match="already cut"):
        headcut.write(cut, tmp_path / "again.gguf", kept)
    with pytest.raises(FlexoffloadError, match="spare"):
        headcut.write(full, tmp_path / "bad.gguf", kept, spare=6)
    for bad in ([], [-1, 2], [shape.n_vocab], range(shape.n_vocab), [3, 17, 3]):
        with pytest.raises(FlexoffloadError, match="distinct token ids"):
            headcut.write(full, tmp_path / "bad.gguf", bad)
    assert not (tmp_path / "bad.gguf").exists() and not (tmp_path / "bad.gguf.part").exists()


def _decoded(e, tokens):
    """The logits of every token of one pass over tokens in the engine's context."""
    batch = speculate._Batch(e.lib, len(tokens), 1)
    batch.fill([(t, i, [0], True) for i, t in enumerate(tokens)])
    assert e.lib.llama_decode(e.ctx, batch.batch) == 0
    n_vocab = e.lib.llama_vocab_n_tokens(e.vocab)
    return np.stack([np.ctypeslib.as_array(e.lib.llama_get_logits_ith(e.ctx, i), shape=(n_vocab,)).copy()
                     for i in range(len(tokens))])


def _logits(path, tokens):
    """The logits of every token of one pass over tokens, the model mapped."""
    settings = speculate.target_settings(engine.Settings(n_ctx=128, n_batch=64, temp=0.0, strategy="mmap"))
    with engine.Engine(path, settings) as e:
        return _decoded(e, tokens)


@pytest.mark.parametrize("qtype", ["Q4_0", "F32"])
@pytest.mark.parametrize("tied", [False, True])
def test_a_cut_head_s_logits_are_the_whole_head_s_at_its_tokens_and_minus_infinity_elsewhere(tmp_path, qtype, tied):
    """Patch 0032: llama.cpp loads a head with fewer rows than the vocabulary where output_ids names their tokens,
    and every output row of a pass has the vocabulary's width: the whole head's logits at the kept tokens, bit
    for bit, and -inf at the others, so no sampler or drafter picks a token the head does not have."""
    shape = replace(synth.SHAPES["qwen2-tiny"], tied_embeddings=tied)
    full = synth.write(tmp_path / "full.gguf", shape, qtype=qtype, seed=7, output_scale=10)
    ids = np.sort(np.random.default_rng(1).choice(shape.n_vocab, 96, replace=False))
    cut = headcut.write(full, tmp_path / "cut.gguf", ids)
    tokens = [5, 40, 77, 120, 9]
    whole, part = _logits(full, tokens), _logits(cut, tokens)
    assert part.shape == whole.shape
    assert np.array_equal(part[:, ids], whole[:, ids])
    others = np.setdiff1d(np.arange(shape.n_vocab), ids)
    assert np.all(np.isneginf(part[:, others]))
    assert np.all(np.isin(part.argmax(axis=1), ids))


def test_a_run_points_the_spare_rows_at_its_prompt_s_tokens_the_head_lacks(tmp_path):
    """The last rows of a cut head are spare: before a prompt, its tokens the head lacks take them (the most
    frequent first, round robin over the rows the prompt's tokens do not hold), their weights read from the file
    the head was cut from, so their logits are the whole head's bit for bit; a token whose row is taken again is
    -inf once more."""
    from flexoffload.speculation import head

    shape = synth.SHAPES["qwen2-tiny"]
    full = synth.write(tmp_path / "full.gguf", shape, qtype="Q4_0", seed=7, output_scale=10)
    kept = np.arange(100, 200)  # rows 96-99 (tokens 196-199) spare
    cut = headcut.write(full, tmp_path / "cut.gguf", kept, spare=4)
    tokens = [5, 40, 40, 77, 220, 9, 40, 5]
    whole = _logits(full, tokens + [250, 300])
    settings = speculate.target_settings(engine.Settings(n_ctx=128, n_batch=64, temp=0.0, strategy="stream"))
    with engine.Engine(cut, settings) as e:
        spare = head.spare(e, cut)
        assert spare is not None and spare.admit(tokens) == 4  # 5, 9, 40, 77 and 220 lack rows: 4 spare rows
        assert spare.tokens == [40, 5, 77, 220] and spare.admit([40, 5, 250, 300, 150]) == 2
        assert spare.tokens == [40, 5, 250, 300]  # the prompt's own rows kept; 150 has a row of its own
        part = _decoded(e, tokens + [250, 300])
        # a token the target outputs takes a row too, never one the prompt's tokens (keep) hold
        assert spare.admit([260, 40], keep={5, 250}) == 1 and spare.tokens == [40, 5, 250, 260]
        assert spare.admit([270, 280], keep={40, 5, 250, 260}) == 0
    held = np.array(sorted(set(range(100, 196)) | {40, 5, 250, 300}))
    assert np.array_equal(part[:, held], whole[:, held])
    assert np.all(np.isneginf(np.delete(part, held, axis=1)))


def test_the_frequent_tokens_are_those_the_corpus_uses_most_with_the_special_ones(tmp_path, monkeypatch,
                                                                                     private_cache):
    from flexoffload.measure import headrows

    monkeypatch.setattr(headrows, "CORPUS_BYTES", 200_000)
    model = load(synth.write(tmp_path / "m.gguf", synth.SHAPES["qwen2-tiny"], seed=2))
    n = headrows.counts(model)
    assert n.shape == (model.n_vocab,) and (n > 0).sum() > 20
    with engine.vocabulary(str(model.path)) as (lib, vocab):
        special = [t for t in range(model.n_vocab) if lib.llama_vocab_is_eog(vocab, t)
                   or lib.llama_vocab_is_control(vocab, t)]
    assert special and np.all(n[special] == n.max())
    rows = headrows.frequent(model, 64)
    assert len(rows) == 64 and np.all(np.diff(n[rows]) <= 0) and set(special) <= set(rows)
    assert n[rows].min() >= np.delete(n, rows).max()  # nothing left out is used more than what is kept
    assert (private_cache / "heads").is_dir()  # counted once: the second call reads them back
    assert np.array_equal(headrows.counts(model), n)


def test_run_md_with_the_draft_s_head_cut_is_made_once_cached_and_lossless(private_cache, tmp_path):
    """--draft-head cut makes the draft's copy with its head cut to the 32,768 tokens a corpus uses most, once into
    the cache, and runs it; greedy output is the target alone's (a token outside the head is never drafted, and the
    target verifies every token). --draft-head full runs the file as given; auto runs whichever the acceptance each
    has measured predicts faster."""
    shape = synth.Shape(n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=40000, n_ctx_train=1024,
                        arch="qwen2")
    target = synth.write(tmp_path / "target.gguf", shape, seed=1, output_seed=2, output_scale=10)
    draft = synth.write(tmp_path / "draft.gguf", replace(shape, n_layer=1), seed=1, output_seed=2, output_scale=10)
    common = ["-m", str(target), "-md", str(draft), "-p", "def add(a, b):", "-n", "24", "--temp", "0", "-c", "256",
              "--json", "--no-history"]
    alone = json.loads(cli("run", *common[:2], *common[4:], "--spec-type", "none", check=True).stdout)
    made = cli("run", *common, "--draft-head", "cut", check=True)
    assert "head cut to 32768 tokens (once, cached)" in made.stderr, made.stderr
    out = json.loads(made.stdout)
    copy = Path(out["draft"]["path"])
    assert copy.parent == private_cache / "heads" and headcut.rows(load(copy)) == 32768
    assert out["tokens"] == alone["tokens"] and "head_pointed" in out["timings"]
    again = cli("run", *common, "--draft-head", "cut", check=True)
    assert "once, cached" not in again.stderr and json.loads(again.stdout)["draft"]["path"] == str(copy)
    assert json.loads(again.stdout)["tokens"] == alone["tokens"]
    full = json.loads(cli("run", *common, "--draft-head", "full", check=True).stdout)
    assert full["draft"]["path"] == str(draft) and full["tokens"] == alone["tokens"]

    # auto: by the speed each is predicted, from the acceptance its history measured (the run's own, kept)
    from flexoffload.api import drafting
    from flexoffload.speculation import control, history

    def measured(rate):  # steps and rows nearly free, so the acceptance decides
        return control.Measured([rate * 20] * 6, [20.0] * 6, [0.1, 20.0], 1e-7, 1e-7)

    kind = history.kind("def add(a, b):")
    auto = [x for x in common if x != "--no-history"] + ["--mem", "300M"]
    for whole_rate, cut_rate, chosen in ((0.95, 0.1, draft), (0.1, 0.95, copy)):
        history.save(drafting.history_file(target, draft), kind, measured(whole_rate))
        history.save(drafting.history_file(target, copy), kind, measured(cut_rate))
        r = cli("run", *auto, check=True)
        assert "measured acceptance" in r.stderr and "head cut to 32768 tokens" in r.stderr, r.stderr
        out = json.loads(r.stdout)
        assert out["draft"]["path"] == str(chosen) and out["tokens"] == alone["tokens"]
