"""What a generation returns (Result), the text it streams as it comes (TextOut), and the streaming runtime's
statistics it reports (stream_timings).

Apart from the engine because speculation (speculate.py) returns the same Result through the same TextOut.
"""

from __future__ import annotations

import codecs
from dataclasses import asdict, dataclass, field


@dataclass
class Result:
    text: str
    tokens: list[int]
    n_prompt: int
    n_gen: int
    ttft_s: float  # from the start of prompt processing to the first generated token
    prompt_tok_s: float
    decode_tok_s: float  # single-token decodes after the first token, over the time they took
    load_s: float
    strategy: str
    stop: str  # "eog", "limit" or "context"
    timings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def of(cls, prompt_tokens: list[int], out: "TextOut", times: tuple[float, float, float], n_decoded: int,
           load_s: float, strategy: str, stop: str, timings: dict) -> "Result":
        """A generation's result (engine and speculation alike). times: the start of prompt processing, the first
        token, the end; n_decoded: the forward passes after the first token that the decode speed counts."""
        t_start, t_first, t_end = times
        text = out.close()
        decode_s = t_end - t_first
        return cls(text=text, tokens=out.tokens, n_prompt=len(prompt_tokens), n_gen=len(out.tokens),
                   ttft_s=t_first - t_start, prompt_tok_s=len(prompt_tokens) / max(t_first - t_start, 1e-9),
                   decode_tok_s=n_decoded / decode_s if n_decoded > 0 and decode_s > 0 else 0.0, load_s=load_s,
                   strategy=strategy, stop=stop, timings=timings)


class TextOut:
    """Generated tokens and their text, handed to on_text piece by piece as it comes (a UTF-8 character that spans
    two tokens is held until it is whole). engine: an engine.Engine, whose piece(token) gives a token's bytes."""

    def __init__(self, engine, on_text=None):
        self.engine, self.on_text = engine, on_text
        self.tokens: list[int] = []
        self.parts: list[str] = []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def emit(self, token: int) -> None:
        self.tokens.append(token)
        self._say(self._utf8.decode(self.engine.piece(token)))

    def close(self) -> str:
        self._say(self._utf8.decode(b"", final=True))
        return "".join(self.parts)

    def _say(self, chunk: str) -> None:
        if chunk:
            self.parts.append(chunk)
            if self.on_text:
                self.on_text(chunk)


def stream_timings(elapsed_s: float, model) -> dict:
    """The streaming runtime's statistics of one model (its llama_model pointer) since stream.reset_stats(), as a
    run's timings; elapsed_s: the run's time, over which what it read is a lower bound of the disk's bandwidth
    (compute overlaps the reads)."""
    from flexoffload.native import stream

    st = stream.stats(model, layers=False)
    timings = {"stream_bytes_read": st.bytes_read, "stream_reads": st.n_reads, "stream_direct": st.n_direct,
               "stream_stall_s": st.t_stall_s, "stream_read_s": st.t_read_s, "stream_passes": st.n_passes,
               "stream_rereads": st.n_rereads, "stream_committed_peak": st.bytes_committed_peak,
               "stream_committed": st.bytes_committed,
               "stream_read_gb_s": st.bytes_read / max(elapsed_s, 1e-9) / 1e9}
    experts = stream.expert_stats()  # of the process: a draft model is dense
    if experts["n_uses"]:
        timings.update(expert_uses=experts["n_uses"], expert_hit_rate=experts["n_hits"] / experts["n_uses"],
                       expert_bytes_read=experts["bytes_read"], expert_cached_peak=experts["bytes_cached_peak"],
                       expert_ahead=experts["n_ahead"], expert_spilled=experts["n_spilled"],
                       expert_predicted=experts["n_predicted"], expert_predicted_used=experts["n_predicted_used"],
                       expert_routed=experts["n_routed"])
    return timings
