"""One tokenizer for the count made before loading and the run's own (issue 27, item 4): a prompt with more tokens
than bytes + 8 (a byte-fallback vocabulary without a lone "▁" spells each space in the three bytes of "▁") is
counted, not refused, and as llama.cpp's own llama-completion counts it."""

import re
import subprocess

import pytest
from conftest import cli

from flexoffload.gguf import synth
from flexoffload.native import tool
from flexoffload.runtime import engine

PROMPT = "Explain why the sky looks blue"  # 30 bytes


@pytest.fixture(scope="module")
def spelled_model(tmp_path_factory, monkeypatch_module):
    """The tiny synthetic model with a vocabulary of plain letters and byte tokens, and no piece that begins with
    "▁": every space (and the prefix space) is spelled in the three bytes of "▁"."""
    vocab = synth._vocab

    def plain(n_vocab):
        v = vocab(n_vocab)
        letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        for i in range(259, n_vocab):
            v.tokens[i] = letters[(i - 259) % 52] + ("" if i - 259 < 52 else str(i))
        return v

    monkeypatch_module.setattr(synth, "_vocab", plain)
    return synth.write(tmp_path_factory.mktemp("spelled") / "spelled.gguf")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def _completion_prompt_tokens(model) -> int:
    """The prompt's tokens as llama-completion reports them (its perf line: 'prompt eval time = ... / N tokens')."""
    r = subprocess.run([str(tool("llama-completion")), "-m", str(model), "-p", PROMPT, "-n", "1", "-no-cnv",
                        "--temp", "0", "-c", "256"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    found = re.search(r"prompt eval time =.*?/\s*(\d+) tokens", r.stderr)
    assert found, r.stderr[-2000:]
    return int(found.group(1))


def test_a_prompt_with_more_tokens_than_bytes_is_counted_as_llama_completion_counts_it(spelled_model):
    n = engine.count_tokens(str(spelled_model), PROMPT)
    assert n > len(PROMPT.encode()) + 8  # the case the first buffer is too small for
    assert n == _completion_prompt_tokens(spelled_model)


def test_run_takes_the_prompt_the_vocabulary_spells_in_bytes(spelled_model):
    r = cli("run", "-m", str(spelled_model), "-p", PROMPT, "-n", "2", "--temp", "0", "-c", "256", "--json")
    assert r.returncode == 0, r.stderr
    assert '"n_prompt": ' in r.stdout and "could not be tokenized" not in r.stderr
