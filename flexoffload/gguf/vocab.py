"""Vocabularies for synthetic GGUF models (gguf/synth.py): a small SentencePiece-style one, or a real model's
copied from its GGUF; the keys a writer adds, their header bytes, and which tokens are not whole UTF-8 pieces."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Vocab:
    """A vocabulary as the GGUF's tokenizer.* keys hold it."""
    model: str  # "llama" (SentencePiece-style) or "gpt2" (byte-level BPE)
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    pre: str | None = None
    bos: int | None = None
    eos: int | None = None
    padding: int | None = None
    add_bos: bool = False
    chat_template: str | None = None

    def silent(self) -> list[bool]:
        """The tokens whose output weights are zero: all but whole pieces of valid UTF-8."""
        import gguf

        normal = [t == gguf.TokenType.NORMAL for t in self.types]
        if self.model != "gpt2":
            return [not n for n in normal]
        decode = {c: b for b, c in _bytes_to_unicode().items()}
        out = []
        for token, n in zip(self.tokens, normal):
            try:
                bytes(decode[c] for c in token).decode("utf-8")
                out.append(not n)
            except (KeyError, UnicodeDecodeError):
                out.append(True)
        return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from a byte to the character byte-level BPE writes it as."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _vocab(n_vocab: int) -> Vocab:
    """<unk>, <s>, </s>, the 256 byte tokens, then filler pieces up to n_vocab."""
    import gguf

    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(tokens) < n_vocab:
        piece = "\u2581" + letters[i % 26] + (letters[(i // 26) % 26] if i >= 26 else "") + (str(i // 676) if i >= 676 else "")
        tokens.append(piece)
        types.append(T.NORMAL)
        i += 1
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(k) for k in range(len(tokens) - 259)]
    return Vocab("llama", tokens[:n_vocab], [int(t) for t in types[:n_vocab]], scores=scores[:n_vocab], bos=1, eos=2,
                 add_bos=True)


def copied_vocab(path: str | Path, n_vocab: int) -> Vocab:
    """A real model's vocabulary from its GGUF, padded with unused tokens up to n_vocab."""
    import gguf

    from flexoffload import FlexoffloadError
    from flexoffload.gguf.model import metadata

    keys = ("tokens", "token_type", "scores", "merges")
    kv = metadata(path, frozenset(f"tokenizer.ggml.{k}" for k in keys))
    tokens, types = kv.get("tokenizer.ggml.tokens"), kv.get("tokenizer.ggml.token_type")
    if not tokens or types is None:
        raise FlexoffloadError(f"{path} holds no tokenizer")
    if len(tokens) > n_vocab:
        raise FlexoffloadError(f"{path}'s {len(tokens)} tokens do not fit a vocabulary of {n_vocab}")
    n_pad = n_vocab - len(tokens)
    scores = kv.get("tokenizer.ggml.scores")
    return Vocab(kv["tokenizer.ggml.model"], tokens + [f"[PAD{i}]" for i in range(n_pad)],
                 types + [int(gguf.TokenType.UNUSED)] * n_pad,
                 scores=scores + [0.0] * n_pad if scores else None, merges=kv.get("tokenizer.ggml.merges"),
                 pre=kv.get("tokenizer.ggml.pre"), bos=kv.get("tokenizer.ggml.bos_token_id"),
                 eos=kv.get("tokenizer.ggml.eos_token_id"), padding=kv.get("tokenizer.ggml.padding_token_id"),
                 add_bos=bool(kv.get("tokenizer.ggml.add_bos_token")), chat_template=kv.get("tokenizer.chat_template"))


def _add_vocab(w, v: Vocab) -> None:
    w.add_tokenizer_model(v.model)
    if v.pre:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    if v.scores:
        w.add_token_scores(v.scores)
    w.add_token_types(v.types)
    if v.merges:
        w.add_token_merges(v.merges)
    if v.model == "llama":
        w.add_unk_token_id(0)
    for add, value in ((w.add_bos_token_id, v.bos), (w.add_eos_token_id, v.eos), (w.add_pad_token_id, v.padding)):
        if value is not None:
            add(value)
    w.add_add_bos_token(v.add_bos)
    if v.chat_template:
        w.add_chat_template(v.chat_template)


def _vocab_header_bytes(v: Vocab) -> int:
    """The tokenizer keys' bytes in the header, to within the allowance predicted_size gives the scalars."""
    array_head = 8 + 32 + 4 + 4 + 8  # key length, a key of about 32 bytes, value type, item type, item count

    def strings(items):
        return array_head + sum(8 + len(t.encode("utf-8")) for t in items)

    out = strings(v.tokens) + array_head + 4 * len(v.types)
    out += array_head + 4 * len(v.scores) if v.scores else 0
    out += strings(v.merges) if v.merges else 0
    out += len(v.chat_template.encode("utf-8")) if v.chat_template else 0
    return out
