"""`run -cnv`: a conversation whose history stays in the KV cache, each turn's reply the model's own for the whole
conversation; the loop's commands; the child of an enforced conversation reading the terminal."""

import json
import os
import subprocess
import sys

from flexoffload.runtime import chat
from flexoffload.runtime.engine import Engine, Settings


def converse(*args: str, stdin: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexoffload", "run", "-cnv", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


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
