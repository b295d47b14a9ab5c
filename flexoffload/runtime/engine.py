"""Generation on the patched llama.cpp through the low-level llama-cpp-python API.

One model and one context, a prompt decoded in batches, then one token at a time, sampled with
llama.cpp's own samplers (greedy at temperature 0, as llama-completion does), text streamed as it
comes, and the timings a benchmark needs.

The run's Settings and the context they make are settings.py's, what a generation returns is results.py's; both are
importable from here too, as they were before they moved (KV_TYPES for options.py).
"""

from __future__ import annotations

import ctypes
import os
import resource
import time
from contextlib import contextmanager

from flexoffload import FlexoffloadError
from flexoffload.defaults import STRATEGIES
from flexoffload.native import llama_cpp
from flexoffload.runtime.config import stream_config
from flexoffload.runtime.results import Result, TextOut, stream_timings
# KV_TYPES too: options.py takes it from here
from flexoffload.runtime.settings import KV_TYPES, Settings, context_params, uses_flash_attention


class _Override(ctypes.Structure):
    """llama_model_tensor_buft_override: the bindings declare the field as a bare pointer."""
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


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


@contextmanager
def vocabulary(model_path: str):
    """(lib, vocab) of the model's vocabulary alone, loaded without its weights."""
    lib = llama_cpp()
    _Log(lib, verbose=False)  # llama.cpp's log kept, not printed
    params = lib.llama_model_default_params()
    params.vocab_only = True
    model = lib.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise FlexoffloadError(f"llama.cpp could not read the vocabulary of {model_path}")
    try:
        yield lib, lib.llama_model_get_vocab(model)
    finally:
        lib.llama_model_free(model)


def count_tokens(model_path: str, text: str) -> int:
    """The prompt's tokens as a run tokenizes it (special tokens added), from the model's vocabulary alone: a
    prompt too long for the context is refused before anything is loaded."""
    with vocabulary(model_path) as (lib, vocab):
        return len(tokenize(lib, vocab, text))


def detokenize(model_path: str, tokens: list[int]) -> str:
    """The text of tokens, piece after piece (a byte sequence that is not UTF-8 replaced)."""
    with vocabulary(model_path) as (lib, vocab):
        buf, out = ctypes.create_string_buffer(256), bytearray()
        for token in tokens:
            n = lib.llama_token_to_piece(vocab, token, buf, len(buf), 0, False)
            out += buf.raw[:max(n, 0)]
        return out.decode("utf-8", errors="replace")


class Engine:
    def __init__(self, model_path: str, settings: Settings, log: _Log | None = None, eval_callback=None):
        """eval_callback: llama.cpp's ggml_backend_sched_eval_callback (a ctypes function), kept for the context's
        life: the scheduler asks it of every node (opprofile.py times operators with it)."""
        if settings.strategy not in STRATEGIES:  # the API's guard: rules.py's budget check refuses the option first
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
            if settings.placed_patterns:  # the API's guard: prepare refuses a saved plan's placement without --rpc
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
            stream_config(settings).apply()  # as llama-server gets it (server.environment)
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

    def _streamed(self) -> tuple[int, float]:
        """What the streaming runtime has read for this model since the prompt began, and the seconds compute waited
        for reads (0 under mmap): at the first token, the prompt's, so that decode's are told apart."""
        if self.settings.strategy == "mmap":
            return 0, 0.0
        from flexoffload.native import stream

        st = stream.stats(self.model, layers=False)
        return st.bytes_read, st.t_stall_s

    def generate(self, prompt: str, n_predict: int, on_text=None, forced: str | None = None) -> Result:
        """Greedy or sampled generation of up to n_predict tokens (-1: until end of text or context). forced: a text
        whose tokens are decoded in place of the sampled ones (teacher forcing), up to n_predict of them."""
        prompt_tokens = self.start(prompt)
        return self.complete(prompt_tokens, n_predict, on_text,
                             forced=self.tokenize(forced, add_special=False) if forced else None)

    def forget(self, n_keep: int) -> None:
        """Drop the KV cache's cells from position n_keep on (a conversation whose next text differs there)."""
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), -1, n_keep, -1)

    def complete(self, prompt_tokens: list[int], n_predict: int, on_text=None, cached: int = 0,
                 forced: list[int] | None = None) -> Result:
        """generate's loop from tokens: the first `cached` of them are in the KV cache already (a conversation's
        earlier turns, runtime/chat.py), the rest are decoded, then up to n_predict tokens generated (forced: these
        in place of the sampled ones; the sampler still runs, so each step costs what it does unforced)."""
        lib = self.lib
        if forced is not None:
            n_predict = len(forced) if n_predict < 0 else min(n_predict, len(forced))
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
                if forced is not None:
                    token = forced[len(tokens)]
                if t_first is None:
                    t_first = time.perf_counter()
                    prompt_read, prompt_stall = self._streamed()
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
        timings = {"forced": True} if forced is not None else {}
        if steps:  # a slow token is what a user notices: a cache's misses come in bursts
            ordered = sorted(steps)
            timings["token_p50_s"] = ordered[len(ordered) // 2]
            timings["token_p95_s"] = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        if self.settings.strategy != "mmap":
            prompt_read, prompt_stall = (prompt_read, prompt_stall) if t_first is not None else self._streamed()
            timings.update(resident_locked=not self.log.mlock_failed, made_resident=self.made_resident,
                           stream_prompt_bytes_read=prompt_read, stream_prompt_stall_s=prompt_stall,
                           stream_decode_s=t_end - t_first if t_first is not None else 0.0,
                           **stream_timings(t_end - t_start, self.model))
        return Result.of(prompt_tokens[cached:], out, (t_start, t_first or t_end, t_end), n_decoded, self.load_s,
                         self.settings.strategy, stop, timings)
