"""`run -cnv`: a conversation whose history stays in the KV cache, each turn's reply the model's own for the whole
conversation; the loop's commands; the child of an enforced conversation reading the terminal."""

import json
import os
import subprocess
import sys

import pytest

from flexoffload.runtime import chat
from flexoffload.runtime.engine import Engine, Settings

# it streams or profiles the real model: what it records of the disk is its own (conftest.module_cache)
pytestmark = pytest.mark.usefixtures("module_cache")


def converse(*args: str, stdin: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexoffload", "run", "-cnv", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.integration
def test_a_later_turn_equals_the_whole_conversation_decoded_afresh(real_model):
    """The second reply, decoded on top of the first turn's cache, is the reply to the whole conversation decoded
    from nothing (greedy): the cache holds what the template would write, the tokens it lacks are decoded."""
    settings = Settings(n_ctx=1024, temp=0)
    with Engine(str(real_model), settings) as engine:
        talk = chat.Chat(engine, system="You answer in one line.")
        first = talk.say("What is 2 + 3?", 24)
        assert talk.cached[:first.n_prompt] == engine.tokenize(talk.format(talk.messages[:2]))
        second = talk.say("And 7 times that?", 24)
        assert second.n_prompt < len(talk.cached) // 2  # only the new message and the markers were decoded
        whole = talk.format(talk.messages[:-1])
        assert whole.count("What is 2 + 3?") == 1 and whole.endswith("assistant\n")
        fresh = engine.generate(whole, 24)
    assert second.tokens == fresh.tokens
    assert second.text.strip()


def test_the_loop_takes_commands_and_the_json_has_each_turn(tiny_model):
    r = converse("-m", str(tiny_model), "--temp", "0", "-n", "4", "-c", "256", "--json",
                 stdin="hello\n\n/what\n/clear\nhello\n/exit\nnot read\n")
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert [t["user"] for t in result["turns"]] == ["hello", "hello"]
    assert all(t["n_gen"] == 4 for t in result["turns"])
    assert result["n_gen"] == 8
    # after /clear the same message is the same conversation: the same reply (greedy), its prompt in the cache
    assert result["turns"][0]["reply"] == result["turns"][1]["reply"]
    assert result["turns"][1]["n_prompt"] == 1
    assert "unknown command /what" in r.stderr and "cleared" in r.stderr


def test_an_enforced_conversation_reads_the_terminal_in_its_cgroup(tiny_model):
    r = converse("-m", str(tiny_model), "--temp", "0", "-n", "3", "-c", "256", "--mem", "200M", "--enforce",
                 "-sys", "You are terse.", stdin="hi\nbye\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") >= 2  # two replies, each ended by a newline
    assert "peak" in r.stderr and "(cgroup)" in r.stderr


def test_bad_conversation_flags_are_one_line_errors(tiny_model):
    r = subprocess.run([sys.executable, "-m", "flexoffload", "run", "-m", str(tiny_model), "-sys", "x", "-p", "y"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "add -cnv" in r.stderr and "Traceback" not in r.stderr
    r = converse("-m", str(tiny_model), "-sys", "x", "-p", "y", stdin="")
    assert r.returncode != 0 and "not two of them" in r.stderr


# --- a conversation that speculates (speculate.converse, speculate.SpeculatingEngine) ------------------------------

def _lines(*messages: str):
    """read_line for converse: the messages in turn, then the end (EOFError)."""
    left = list(messages)

    def read_line() -> str:
        if not left:
            raise EOFError
        return left.pop(0)

    return read_line


def _plain_conversation(path, settings, messages, n_predict, system=None) -> dict:
    with Engine(str(path), settings) as engine:
        return chat.converse(engine, system, n_predict, _lines(*messages), None, lambda line: None)


def _tiny_pair(directory):
    from dataclasses import replace

    from flexoffload.gguf import synth

    target = synth.write(directory / "target.gguf", seed=3, output_seed=4, output_scale=10)
    draft = synth.write(directory / "draft.gguf", shape=replace(synth.TINY, n_layer=2), seed=3, output_seed=4,
                        output_scale=10)
    return target, draft


def test_a_speculating_conversation_replies_as_the_plain_one(tmp_path):
    """Greedy, each turn's reply by speculation (free drafters, a draft model, both) equals the plain conversation's
    on the same engine settings, and each turn decodes as many tokens (the caches keep the same history); /clear
    gives the rejected cells back."""
    from flexoffload.speculation import speculate
    from flexoffload.speculation.tree import Options

    target, draft = _tiny_pair(tmp_path)
    settings = Settings(n_ctx=512, n_batch=64, temp=0)
    messages = ("hello", "abc abc abc", "and then?", "/clear", "hello", "The quick brown fox")
    plain = _plain_conversation(target, settings, messages, 24, system="You are terse.")
    assert len(plain["turns"]) == 5
    for draft_path, names in ((None, ("ngram-simple", "recycle")), (draft, ()), (draft, ("ngram-simple",))):
        spoken = speculate.converse(target, settings, draft_path, Options(), names, None, "You are terse.", 24,
                                    _lines(*messages), None, lambda line: None)
        assert [t["reply"] for t in spoken["turns"]] == [t["reply"] for t in plain["turns"]], (draft_path, names)
        assert [t["n_prompt"] for t in spoken["turns"]] == [t["n_prompt"] for t in plain["turns"]]
        assert spoken["strategy"] == "mmap+tree" and spoken["timings"]["n_verify"] > 0
        assert spoken["timings"]["tokens_per_pass"] > 1 and all(t["n_verify"] for t in spoken["turns"])


def _turns_and_forgetting(talker, dead=None) -> list[list[int]]:
    """Two turns, then the conversation's next prompt completed after forgetting from past the first tree, and
    again from before it: each reply's tokens. dead(): the last position of a rejected cell (speculation's)."""
    talk = chat.Chat(talker)
    replies = [talk.say("hello", 32).tokens, talk.say("abc abc abc", 32).tokens]
    floor = len(talker.tokenize(talk.format(talk.messages[:1])))  # the first reply's first position
    tokens = talker.tokenize(talk.format(talk.messages + [("user", "and then?")]))
    for keep in (floor + 1, floor):
        talker.forget(keep)
        if dead is not None:
            assert talker.tree_floor == (floor if keep > floor else None)
            assert (dead() > floor) if keep > floor else dead() == -1  # kept past the first tree, else freed
        replies.append(talker.complete(tokens, 32, cached=keep).tokens)
    return replies


def test_speculating_turns_keep_the_history_and_forget_frees_rejected_cells_only_before_any_tree(tmp_path):
    """The KV bookkeeping across turns, against a plain engine's: forgetting past the first tree keeps the rejected
    cells (freed, later tokens would fill them before older history), forgetting before it frees them; the replies
    after either are the plain engine's."""
    from flexoffload.speculation import speculate
    from flexoffload.speculation.tree import Options

    target, draft = _tiny_pair(tmp_path)
    settings = Settings(n_ctx=512, n_batch=64, temp=0)
    with Engine(str(target), settings) as engine:
        plain = _turns_and_forgetting(engine)
    # LLMCad's rules: the measured ones may turn a tiny draft off (its step costs what the pass does), and then no tree
    # leaves rejected cells to keep
    with speculate.loaded(target, settings, draft, Options(control="llmcad", threshold=0.05)) as speculator:
        mem = speculator.lib.llama_get_memory(speculator.target.ctx)

        def dead() -> int:
            return speculator.lib.llama_memory_seq_pos_max(mem, speculate.DEAD_SEQ)

        spoken = _turns_and_forgetting(speculate.SpeculatingEngine(speculator), dead)
    assert spoken == plain


@pytest.mark.integration
def test_real_speculating_conversation_replies_as_the_plain_one(real_model):
    """The 1.5B with the 0.5B draft, and with free drafters: three turns, greedy, the replies of the plain
    conversation, the later turns decoding only their new messages."""
    from flexoffload.gguf import catalog
    from flexoffload.speculation import speculate
    from flexoffload.speculation.tree import Options

    draft = catalog.model_path(catalog.CATALOG["qwen2.5-coder-0.5b-instruct"])
    settings = Settings(n_ctx=2048, n_batch=512, temp=0, strategy="mmap")
    messages = ("Write a Python function that reverses a string.", "Now make it return None for None.",
                "Say in one sentence what it does.")
    plain = _plain_conversation(real_model, settings, messages, 48, system="You answer briefly.")
    for draft_path, names in ((draft, ("ngram-simple",)), (None, ("ngram-simple", "recycle"))):
        spoken = speculate.converse(real_model, settings, draft_path, Options(), names, None, "You answer briefly.",
                                    48, _lines(*messages), None, lambda line: None)
        assert [t["reply"] for t in spoken["turns"]] == [t["reply"] for t in plain["turns"]], names
        assert [t["n_prompt"] for t in spoken["turns"]] == [t["n_prompt"] for t in plain["turns"]]
        assert spoken["turns"][1]["n_prompt"] < spoken["turns"][0]["n_prompt"] + spoken["turns"][0]["n_gen"]
    assert spoken["timings"]["tokens_per_pass"] > 1
