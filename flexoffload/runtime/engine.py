"""Generation on the patched llama.cpp through the low-level llama-cpp-python API.

One model and one context, a prompt decoded in batches, then one token at a time, sampled with
llama.cpp's own samplers (greedy at temperature 0, as llama-completion does), text streamed as it
comes, and the timings a benchmark needs.
"""

from __future__ import annotations

import codecs
import ctypes
import os
import resource
import time
from dataclasses import asdict, dataclass, field

from flexoffload import FlexoffloadError
from flexoffload.defaults import CHUNK_BYTES, IO_THREADS, STRATEGIES, WINDOW
from flexoffload.native import llama_cpp


class _Override(ctypes.Structure):
    """llama_model_tensor_buft_override: the bindings declare the field as a bare pointer."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass
class Settings:
    n_ctx: int = 2048
    n_batch: int = 512
    n_threads: int = os.cpu_count() or 1
    temp: float = 0.8
    seed: int = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed
    strategy: str = "mmap"
    streamed_patterns: tuple[str, ...] = ()  # regexes (tensors.ot) of the tensors to stream
    window: int = WINDOW
    io_threads: int = IO_THREADS
    chunk_bytes: int = CHUNK_BYTES  # streamed tensors larger than this are read in row chunks
    expert_slots: int = -1  # a mixture of experts: experts each layer keeps between tokens (-1: all it read)
    expert_whole: bool = False  # its expert tensors stream whole, by the window, not by expert
    n_outputs: int = 1  # logits rows one forward pass returns (a speculation tree needs one per node)
    n_seq_max: int = 1  # sequences in the KV cache (a speculation tree: one per branch, in one unified cache)
    n_ubatch: int = 0  # tokens a forward pass computes at once (llama.cpp's -ub); 0: n_batch
    flash_attn: str = "auto"  # on, off, or auto (llama.cpp decides: on for this CPU backend)
    type_k: str = "f16"  # the KV cache's types (-ctk, -ctv); a quantized V needs flash attention
    type_v: str = "f16"
    decode_ubatch: int = 0  # after the prompt: the ubatch decode runs with (its compute buffers sized for it); 0: same
    resident_after_prefill: tuple[str, ...] = ()  # streamed tensors made resident when decode starts (prefill.py)
    rpc: tuple[str, ...] = ()  # RPC servers (HOST:PORT) whose devices tensors may be placed on
    n_gpu_layers: int = 0  # with rpc: the last layers llama.cpp offloads to those devices, KV cache with them (-ngl)
    tensor_split: tuple[float, ...] = ()  # with rpc: their shares of those layers per device (-ts); () upstream's
    placed_patterns: tuple[tuple[str, str], ...] = ()  # (regex, buffer type name) of tensors on another device
    verbose: bool = False


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
    two tokens is held until it is whole)."""

    def __init__(self, engine: "Engine", on_text=None):
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
               "stream_read_gb_s": st.bytes_read / max(elapsed_s, 1e-9) / 1e9}
    experts = stream.expert_stats()  # of the process: a draft model is dense
    if experts["n_uses"]:
        timings.update(expert_uses=experts["n_uses"], expert_hit_rate=experts["n_hits"] / experts["n_uses"],
                       expert_bytes_read=experts["bytes_read"], expert_cached_peak=experts["bytes_cached_peak"])
    return timings


class _Log:
    """Routes llama.cpp's log: kept in memory (errors are reported from it), printed only if verbose."""

    def __init__(self, lib, verbose: bool, keep: int | None = 200):
        self.lines: list[str] = []
        self.n_seen = 0  # lines logged in all, kept or not (what one call logged: the last n_seen - before)
        self.keep = keep  # the last lines kept (None: all, for footprint's probe)
        self.verbose = verbose
        self.mlock_failed = False  # llama.cpp only warns when it cannot lock a buffer

        def callback(level, text, user_data):
            line = text.decode("utf-8", "replace")
            if "failed to mlock" in line or "mlock not supported" in line:
                self.mlock_failed = True
            self.lines.append(line)
            self.n_seen += 1
            if self.keep is not None:
                del self.lines[:-self.keep]
            if self.verbose:
                os.write(2, text)

        self._callback = lib.llama_log_callback(callback)  # kept alive as long as the log is set
        lib.llama_log_set(self._callback, ctypes.c_void_p(0))

    def last_error(self) -> str:
        """The line that says why: llama.cpp's loader says the cause ("error loading model: ...") before the
        generic "failed to load model", so that one first."""
        for words in (("error loading model",), ("error", "failed")):
            for line in reversed(self.lines):
                if any(w in line.lower() for w in words):
                    return line.strip()
        return self.lines[-1].strip() if self.lines else "no log"


def drop_file_cache(path) -> None:
    """Give back the page cache that reading a file left behind (posix_fadvise DONTNEED).

    Resident tensors are read into their own locked memory, so the page cache their reading fills is of no more
    use, but a memory cgroup charges it and stays at its limit. There every read from then on waited for the
    kernel to reclaim: the 1.5B at 0.7x of its size streamed at 2.2-2.4 tok/s in a cgroup of 1.0x, and at
    3.6-3.7 with this cache given back (3.8 outside any cgroup)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def raise_memlock_limit() -> int:
    """Raise RLIMIT_MEMLOCK's soft limit to the hard limit (what an unprivileged process may lock); returns it.

    Without CAP_IPC_LOCK the soft limit (often 8 MiB) caps mlock; locking more fails, and llama.cpp then only
    warns and leaves the buffer unlocked.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_MEMLOCK, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def tokenize(lib, vocab, text: str, add_special: bool = True) -> list[int]:
    """text's tokens in vocab, as llama.cpp tokenizes it (parse_special: the chat template's markers are tokens).
    A text can have more tokens than bytes (a byte-fallback vocabulary spells a missing piece in its bytes' tokens:
    a space without a lone "▁" is three): llama_tokenize then returns minus the count needed, asked again."""
    data = text.encode("utf-8")
    n_max = len(data) + 8
    for _ in range(2):
        buf = (lib.llama_token * n_max)()
        n = lib.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, True)
        if n >= 0:
            return list(buf[:n])
        if -n <= n_max:
            break
        n_max = -n
    raise FlexoffloadError("prompt could not be tokenized")


def count_tokens(model_path: str, text: str) -> int:
    """The prompt's tokens as a run tokenizes it (special tokens added), from the model's vocabulary alone: a
    prompt too long for the context is refused before anything is loaded."""
    lib = llama_cpp()
    _Log(lib, verbose=False)  # llama.cpp's log kept, not printed
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise FlexoffloadError(f"llama.cpp could not read the vocabulary of {model_path}")
    try:
        return len(tokenize(lib, lib.llama_model_get_vocab(model), text))
    finally:
        lib.llama_model_free(model)


FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}  # enum llama_flash_attn_type
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}  # enum ggml_type


def context_params(lib, settings: Settings):
    """llama.cpp's context parameters for a run with these settings (footprint's probe makes the same context)."""
    cparams = lib.llama_context_default_params()
    cparams.n_ctx = settings.n_ctx
    cparams.n_batch = settings.n_batch
    cparams.n_ubatch = settings.n_ubatch or settings.n_batch
    cparams.flash_attn_type = FLASH_ATTN[settings.flash_attn]
    cparams.type_k, cparams.type_v = KV_TYPES[settings.type_k], KV_TYPES[settings.type_v]
    # generation reads only the last token's logits: reserving 1 output instead of n_batch shrinks the
    # compute buffer (measured for the 1.5B at -b 512: 303 MiB down to 67 MiB)
    cparams.n_outputs_max = settings.n_outputs
    cparams.n_seq_max = settings.n_seq_max
    cparams.kv_unified = True  # one cache of n_ctx cells that all sequences share (tree branches share prefixes)
    # sliding-window layers keep only their window's cells, as llama.cpp's tools do (the C default keeps n_ctx);
    # a speculation tree keeps the full cache: its rejected cells are removed after later ones were written
    cparams.swa_full = settings.n_seq_max > 1
    cparams.n_threads = settings.n_threads
    cparams.n_threads_batch = settings.n_threads
    return cparams


def uses_flash_attention(settings: Settings, context_log: list[str]) -> bool:
    """Whether a context computes attention with flash attention: as -fa says, or where it is auto as llama.cpp
    resolved it (context_log: what it logged making the context). It turns auto off where a layer's attention would
    run on another device than the layer (a tensor placed on an RPC server draws the attention there)."""
    if settings.flash_attn != "auto":
        return settings.flash_attn == "on"
    return not any("Flash Attention not supported" in line for line in context_log)


class Engine:
    def __init__(self, model_path: str, settings: Settings, log: _Log | None = None, eval_callback=None):
        """eval_callback: llama.cpp's ggml_backend_sched_eval_callback (a ctypes function), kept for the context's
        life: the scheduler asks it of every node (opprofile.py times operators with it)."""
        if settings.strategy not in STRATEGIES:
            raise FlexoffloadError(f"unknown strategy {settings.strategy!r}: one of {', '.join(STRATEGIES)}")
        self.settings = settings
        lib = self.lib = llama_cpp()
        self.log = log or _Log(lib, settings.verbose)
        t0 = time.perf_counter()

        mparams = lib.llama_model_default_params()
        # no repacking: under mmap it doubles memory, and it changes the kernels, so greedy output would differ
        mparams.use_extra_bufts = False
        overrides = []
        if settings.rpc:
            from flexoffload.native import devices

            handles = devices.register_rpc(list(settings.rpc))
            self._devices = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
            # the last n_gpu_layers layers go to the devices, split as upstream splits them (in proportion to their
            # free memory), each with its KV cache; llama.cpp's default would offload them all. The rest stay on
            # the CPU, where the plan may still place tensors one by one, by override
            mparams.n_gpu_layers = settings.n_gpu_layers
            if settings.tensor_split:
                self._split = (ctypes.c_float * lib.LLAMA_MAX_DEVICES)(*settings.tensor_split)
                mparams.tensor_split = self._split
            overrides += [(p.encode(), devices.buffer_type(b)) for p, b in settings.placed_patterns]
        else:
            if settings.placed_patterns:
                raise FlexoffloadError("the plan places tensors on other devices: give their servers with --rpc")
            # no device but the CPU: an RPC server an earlier engine of this process registered is in ggml's
            # registry, and llama.cpp would offload every layer to it by default
            self._devices = (ctypes.c_void_p * 1)(None)
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)
        if settings.strategy == "mmap":
            mparams.load_mode = lib.LLAMA_LOAD_MODE_MMAP
        else:  # resident tensors read once into memory and locked there; streamed ones read by the prefetch threads
            from flexoffload.native import stream

            # mlock: llama.cpp locks every host buffer of weights when it allocates it. The streamed buffer is
            # not a host buffer (its data is not always there), so only the resident tensors are locked; the
            # streamed ones keep giving their pages back after use. A failed lock is a warning, not an error.
            raise_memlock_limit()
            mparams.load_mode = lib.LLAMA_LOAD_MODE_MLOCK
            stream.configure(settings.window, settings.io_threads, chunk_bytes=settings.chunk_bytes)
            stream.configure_experts(settings.expert_slots, whole=settings.expert_whole)
            buft = stream.buffer_type()
            overrides = [(p.encode(), buft) for p in settings.streamed_patterns] + overrides
        if overrides:
            self._overrides = (_Override * (len(overrides) + 1))(*overrides, (None, None))
            mparams.tensor_buft_overrides = ctypes.cast(self._overrides, ctypes.c_void_p)
        self.model = lib.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise FlexoffloadError(f"llama.cpp could not load {model_path}: {self.log.last_error()}")
        if settings.strategy != "mmap":
            drop_file_cache(model_path)

        cparams = context_params(lib, settings)
        if eval_callback is not None:
            self._eval_callback = eval_callback
            cparams.cb_eval = eval_callback
        seen = self.log.n_seen
        self.ctx = lib.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise FlexoffloadError(f"llama.cpp could not make a context (n_ctx={settings.n_ctx}): {self.log.last_error()}")
        logged = self.log.lines[max(len(self.log.lines) - (self.log.n_seen - seen), 0):]
        self.flash_attention = uses_flash_attention(settings, logged)  # speculation verifies bit-exactly only with it
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_ctx = lib.llama_n_ctx(self.ctx)  # llama.cpp pads the context to 256
        self.n_batch = lib.llama_n_batch(self.ctx)  # and caps the batch by it
        self.load_s = time.perf_counter() - t0
        self.made_resident = 0  # streamed tensors made resident after the prompt (_after_prefill)
        self.decoding = False  # decode's memory taken (once: a conversation's later prompts run in it too)

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lib.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lib.llama_model_free(self.model)
            self.model = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return tokenize(self.lib, self.vocab, text, add_special)

    def piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = self.lib.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:max(n, 0)]

    def last_logits(self):
        """The logits of the last decoded token, as a numpy array (a copy)."""
        import numpy as np

        n_vocab = self.lib.llama_vocab_n_tokens(self.vocab)
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, -1), shape=(n_vocab,)).copy()

    def _sampler(self):
        lib, s = self.lib, self.settings
        chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        if s.temp <= 0:
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_greedy())
        else:  # llama.cpp's default chain, without the samplers that are off by default
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_k(40))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(0.95, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_min_p(0.05, 1))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(s.temp))
            lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(s.seed & 0xFFFFFFFF))
        return chain

    def _decode(self, tokens: list[int]) -> None:
        arr = (self.lib.llama_token * len(tokens))(*tokens)
        rc = self.lib.llama_decode(self.ctx, self.lib.llama_batch_get_one(arr, len(tokens)))
        if self.settings.strategy != "mmap":
            # a streamed tensor that could not be read was handed to compute zero-filled: the outputs of this
            # decode are meaningless, report the read error instead (every streaming strategy, window 0 too)
            from flexoffload.native import stream

            err = stream.error()
            if err:
                raise FlexoffloadError(err)
        if rc != 0:
            raise FlexoffloadError(f"llama_decode failed ({rc}): {self.log.last_error()}")

    def start(self, prompt: str, n_ctx: int | None = None) -> list[int]:
        """The prompt's tokens, checked against the context (n_ctx: a smaller one, as a speculation pair's); the
        KV cache cleared and the streaming statistics reset for a new generation."""
        prompt_tokens = self.tokenize(prompt)
        n_ctx = n_ctx or self.n_ctx
        if not prompt_tokens:
            raise FlexoffloadError("the prompt is empty")
        if len(prompt_tokens) >= n_ctx:
            raise FlexoffloadError(
                f"the prompt is {len(prompt_tokens)} tokens, longer than the context of {n_ctx}: raise -c")
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        if self.settings.strategy != "mmap":
            from flexoffload.native import stream

            stream.reset_stats()
        return prompt_tokens

    def _after_prefill(self) -> None:
        """Decode's memory, once the prompt is in: the compute buffers shrink to the decode ubatch's (freed first),
        then the tensors their memory holds stop streaming, each read once (patches 0013-0015)."""
        s = self.settings
        if s.decode_ubatch and s.decode_ubatch < (s.n_ubatch or s.n_batch):
            from flexoffload.native import stream

            stream.set_n_ubatch(self.ctx, s.decode_ubatch)
            self.made_resident = stream.make_resident(self.model, s.resident_after_prefill)

    def generate(self, prompt: str, n_predict: int, on_text=None) -> Result:
        """Greedy or sampled generation of up to n_predict tokens (-1: until end of text or context)."""
        return self.complete(self.start(prompt), n_predict, on_text)

    def forget(self, n_keep: int) -> None:
        """Drop the KV cache's cells from position n_keep on (a conversation whose next text differs there)."""
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), -1, n_keep, -1)

    def complete(self, prompt_tokens: list[int], n_predict: int, on_text=None, cached: int = 0) -> Result:
        """generate's loop from tokens: the first `cached` of them are in the KV cache already (a conversation's
        earlier turns, runtime/chat.py), the rest are decoded, then up to n_predict tokens generated."""
        lib = self.lib
        sampler = self._sampler()
        out, stop = TextOut(self, on_text), "limit"
        tokens = out.tokens
        try:
            t_start = time.perf_counter()
            for i in range(cached, len(prompt_tokens), self.n_batch):
                self._decode(prompt_tokens[i:i + self.n_batch])
            n_past, n_decoded = len(prompt_tokens), 0
            t_first, steps = None, []  # each decode pass's time
            while n_predict < 0 or len(tokens) < n_predict:
                token = lib.llama_sampler_sample(sampler, self.ctx, -1)
                if t_first is None:
                    t_first = time.perf_counter()
                if lib.llama_vocab_is_eog(self.vocab, token):
                    stop = "eog"
                    break
                out.emit(token)
                if len(tokens) == 1 and not self.decoding:  # the first token is out: decode's memory from here
                    self._after_prefill()
                    self.decoding = True
                if n_past >= self.n_ctx:
                    stop = "context"
                    break
                if n_predict >= 0 and len(tokens) >= n_predict:
                    break
                t_step = time.perf_counter()
                self._decode([token])
                steps.append(time.perf_counter() - t_step)
                n_past += 1
                n_decoded += 1
            t_end = time.perf_counter()
        finally:
            lib.llama_sampler_free(sampler)
        timings = {}
        if steps:  # a slow token is what a user notices: a cache's misses come in bursts
            ordered = sorted(steps)
            timings["token_p50_s"] = ordered[len(ordered) // 2]
            timings["token_p95_s"] = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        if self.settings.strategy != "mmap":
            timings.update(resident_locked=not self.log.mlock_failed, made_resident=self.made_resident,
                           **stream_timings(t_end - t_start, self.model))
        return Result.of(prompt_tokens[cached:], out, (t_start, t_first or t_end, t_end), n_decoded, self.load_s,
                         self.settings.strategy, stop, timings)
