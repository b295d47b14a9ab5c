"""A conversation at the terminal (`run -cnv`, as llama-cli's conversation mode and `ollama run` give it): the model's
chat template (llama.cpp's own, as llama-server applies it without --jinja), the history kept in the KV cache, so a
turn decodes only the tokens the cache lacks (its new message and the template's markers)."""

from __future__ import annotations

import ctypes
import time

from flexoffload import FlexoffloadError

HELP = "/exit or Ctrl-D ends, /clear forgets the conversation, Ctrl-C stops a reply"
FALLBACK_TEMPLATE = b"chatml"  # llama-cli's, for a model without a template


class Chat:
    """One conversation on one engine: its messages and the tokens its KV cache holds."""

    def __init__(self, engine, system: str | None = None):
        self.engine = engine
        self.start = [("system", system)] if system else []
        self.messages: list[tuple[str, str]] = list(self.start)
        self.cached: list[int] = []  # the tokens in the KV cache, in position order
        lib = engine.lib
        self.template = lib.llama_model_chat_template(engine.model, None) or FALLBACK_TEMPLATE

    def clear(self) -> None:
        """Forget the conversation (the system message stays; the cache keeps what the next turn shares)."""
        self.messages = list(self.start)

    def format(self, messages: list[tuple[str, str]]) -> str:
        """The messages in the chat template, ending with the assistant's turn opened."""
        lib = self.engine.lib
        keep = [(role.encode(), content.encode()) for role, content in messages]
        chat = (lib.llama_chat_message * len(keep))(*[lib.llama_chat_message(r, c) for r, c in keep])
        size = 1024 + sum(len(c) for _, c in keep) * 2
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lib.llama_chat_apply_template(self.template, chat, len(keep), True, buf, size)
            if n < 0:
                raise FlexoffloadError(f"llama.cpp does not know the model's chat template ({self.template[:40]!r})")
            if n <= size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n
        raise FlexoffloadError("the chat template's text kept growing")

    def say(self, text: str, n_predict: int, on_text=None):
        """The model's reply to text (an engine.Result): the conversation formatted, the tokens the cache shares kept,
        the rest decoded, then up to n_predict tokens (-1: to the end of its turn)."""
        messages = self.messages + [("user", text)]
        tokens = self.engine.tokenize(self.format(messages))
        n_ctx = self.engine.n_ctx
        if len(tokens) >= n_ctx:
            raise FlexoffloadError(f"the conversation is {len(tokens)} tokens, longer than the context of {n_ctx}: "
                                   "/clear, or raise -c")
        keep = 0
        for a, b in zip(self.cached, tokens[:-1]):  # at least the last token is decoded: its logits are the reply's
            if a != b:
                break
            keep += 1
        self.cached = []  # until the turn is through: an interrupted one leaves the cache unknown
        self.engine.forget(keep)
        result = self.engine.complete(tokens, n_predict, on_text, cached=keep)
        # the last token generated is not decoded where the reply stopped at the limit or the context
        self.cached = tokens + (result.tokens if result.stop == "eog" else result.tokens[:-1])
        self.messages = messages + [("assistant", result.text)]
        return result


def converse(engine, system: str | None, n_predict: int, read_line, on_text, note) -> dict:
    """The conversation loop: read_line() gives each message (EOFError ends), on_text(piece) writes the reply as it
    comes, note(line) says the rest. Returns the turns' totals, in the shape of a run's result."""
    chat = Chat(engine, system)
    turns = []
    write = on_text or (lambda piece: None)  # --json: the replies only in the result
    while True:
        try:
            line = read_line()
        except (EOFError, KeyboardInterrupt):
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            break
        if text == "/clear":
            chat.clear()
            note("(the conversation is cleared)")
            continue
        if text.startswith("/"):
            note(f"(unknown command {text.split()[0]}: {HELP})")
            continue
        t0 = time.perf_counter()
        try:
            result = chat.say(text, n_predict, on_text)
        except KeyboardInterrupt:
            write("\n")
            note("(stopped; the message is dropped)")
            continue
        except FlexoffloadError as e:  # a conversation past the context: the user may /clear
            note(f"flexoffload: {e}")
            continue
        write("\n")
        if result.stop == "context":
            note("(the context is full: /clear, or raise -c)")
        turns.append({"user": text, "reply": result.text, "n_prompt": result.n_prompt, "n_gen": result.n_gen,
                      "ttft_s": result.ttft_s, "decode_tok_s": result.decode_tok_s, "stop": result.stop,
                      "wall_s": time.perf_counter() - t0})
    return summary(turns, engine)


def summary(turns: list[dict], engine) -> dict:
    """A conversation's result: its turns, and their totals as a run reports them (prompt tokens decoded, first-token
    time and decode speed over all turns)."""
    n_prompt = sum(t["n_prompt"] for t in turns)
    ttft = sum(t["ttft_s"] for t in turns)
    n_gen = sum(t["n_gen"] for t in turns)
    decoded = [(t["n_gen"] - 1, (t["n_gen"] - 1) / t["decode_tok_s"]) for t in turns if t["decode_tok_s"]]
    decode_s = sum(s for _, s in decoded)
    return {"text": "".join(t["reply"] for t in turns), "turns": turns, "n_prompt": n_prompt, "n_gen": n_gen,
            "ttft_s": ttft / len(turns) if turns else 0.0, "prompt_tok_s": n_prompt / ttft if ttft > 0 else 0.0,
            "decode_tok_s": sum(n for n, _ in decoded) / decode_s if decode_s > 0 else 0.0,
            "load_s": engine.load_s, "strategy": engine.settings.strategy, "timings": {}}
