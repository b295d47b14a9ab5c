"""Which experts a text routes to, measured (issue 28, item 3): a Trace of every token's experts in every layer.

llama.cpp names the router's choice `ffn_moe_topk-<layer>` (build_moe_ffn: the top-k view of the argsort of the
router's probabilities, I32, ne[0] = n_expert_used, ne[1] = the ubatch's tokens). The scheduler's eval callback is
asked of every node; answering yes for those nodes only makes it compute up to each and hand it over, so the ids are
copied out as each layer chooses, and the rest of the graph runs as it would. The text is decoded in ubatches, in
order, in context chunks of up to CTX tokens (the KV cache cleared between chunks); every token is an output, so the
last layer computes every token (llama.cpp otherwise drops all but the outputs before the last layer's FFN).

Decode routes a token as the prompt does, given the same tokens before it (greedy teacher forcing, up to the
rounding of a batch's kernels): a trace of a text is what decoding that text would route. The default text is the
HumanEval tuning problems with their solutions (never the evaluation problems), the first MAX_TOKENS tokens.
Traces are cached per model file and text under the profiles cache.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os

import numpy as np

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, content_key, file_key, write_atomic
from flexoffload.gguf.model import Model
from flexoffload.measure import Progress, profiler
from flexoffload.plan.replay import Trace
from flexoffload.prompts import humaneval

MAX_TOKENS = 4096  # of the calibration text: a few thousand tokens
CTX = 1024  # a context chunk, at most (the model's training context if smaller)
UBATCH = 256
TOPK = b"ffn_moe_topk-"
VERSION = "v1"

log = logging.getLogger(__name__)

# struct ggml_tensor in the pinned ggml.h: type (4, padded to 8), buffer (8), ne (4 x int64), nb (4 x size_t), ...
_OFFSET_NE = 16
_OFFSET_NB = _OFFSET_NE + 32


def calibration_text() -> str:
    return humaneval.solved(humaneval.TUNING)


class Recorder:
    """The eval callback: asks for each ffn_moe_topk node, and copies its ids out by layer."""

    def __init__(self, base):
        self.base = base
        self.ids: dict[int, np.ndarray] = {}
        self.error: Exception | None = None  # raised after the decode: a callback cannot raise through C

    def clear(self) -> None:
        """Before each ubatch: what the last one copied out is taken."""
        self.ids.clear()

    def __call__(self, t, ask, _user_data) -> bool:
        name = self.base.ggml_get_name(t)
        if not name.startswith(TOPK):
            return False  # not wanted: computed with the nodes around it
        if ask:
            return True
        layer = int(name[len(TOPK):])
        ne = (ctypes.c_int64 * 2).from_address(t + _OFFSET_NE)
        nb = (ctypes.c_size_t * 2).from_address(t + _OFFSET_NB)
        data = self.base.ggml_get_data(t)
        span = (ne[1] - 1) * nb[1] + ne[0] * nb[0]
        buf = (ctypes.c_char * span).from_address(data)
        self.ids[layer] = np.ndarray((ne[1], ne[0]), np.int32, buf, 0, (nb[1], nb[0])).copy()
        return True


def measure(model: Model, text: str | list[int], n_threads: int, max_tokens: int = MAX_TOKENS, n_ctx: int = CTX,
            n_ubatch: int = UBATCH, source: str = "") -> Trace:
    """Decode the text (or its tokens) in this process (mmap), its first max_tokens tokens, and record each one's
    experts in every layer."""
    from flexoffload import native

    if not model.n_expert:
        raise FlexoffloadError(f"{model.path.name} is not a mixture of experts: it has no experts to trace")
    recorder = Recorder(native.graph_tensors())
    rows = [ubatch_ids(model, recorder.ids, n)
            for n in decode(model, text, n_threads, recorder, "tracing experts", max_tokens, n_ctx, n_ubatch)]
    n_tokens = sum(len(r) for r in rows)
    return Trace(model.n_layer, model.n_expert, model.n_expert_used, np.concatenate(rows),
                 f"{source}, {n_tokens} tokens" if source else f"{n_tokens} tokens")


def decode(model: Model, text: str | list[int], n_threads: int, recorder, what: str, max_tokens: int = MAX_TOKENS,
           n_ctx: int = CTX, n_ubatch: int = UBATCH):
    """Decode the text's first max_tokens tokens (or of its tokens) in this process (mmap), the recorder the eval
    callback, as the module's docstring says (ubatches in order, context chunks, every token an output). Yields
    each ubatch's token count after its decode, the recorder holding what it copied out (cleared before each);
    an error the recorder kept (a callback cannot raise through C) is raised then."""
    from flexoffload import native
    from flexoffload.runtime import engine

    n_ctx = min(n_ctx, model.n_ctx_train or n_ctx)
    n_ubatch = min(n_ubatch, n_ctx)
    lib = native.llama_cpp()
    callback = lib.ggml_backend_sched_eval_callback(recorder)
    settings = engine.Settings(n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, n_threads=n_threads,
                               strategy="mmap", temp=0, n_outputs=n_ubatch)
    with engine.Engine(str(model.path), settings, eval_callback=callback) as eng:
        tokens = (eng.tokenize(text) if isinstance(text, str) else list(text))[:max_tokens]
        if not tokens:
            raise FlexoffloadError(f"the text has no tokens ({what})")
        memory = lib.llama_get_memory(eng.ctx)
        progress = Progress(log, what, len(tokens), "tokens")
        outputs = (ctypes.c_int8 * n_ubatch)(*([1] * n_ubatch))  # every token an output: see the docstring
        for start in range(0, len(tokens), n_ctx):
            lib.llama_memory_clear(memory, True)
            chunk = tokens[start:start + n_ctx]
            for i in range(0, len(chunk), n_ubatch):
                part = chunk[i:i + n_ubatch]
                recorder.clear()
                arr = (lib.llama_token * len(part))(*part)
                batch = lib.llama_batch_get_one(arr, len(part))
                batch.logits = ctypes.cast(outputs, type(batch.logits))
                rc = lib.llama_decode(eng.ctx, batch)
                if recorder.error is not None:
                    raise recorder.error
                if rc != 0:
                    raise FlexoffloadError(f"llama_decode failed ({rc}) while {what}: {eng.log.last_error()}")
                yield len(part)
                progress(start + i + len(part))


def computable(model: Model) -> bool:
    """A synthetic mixture of experts written with "text" routing (its name says so): its trace can be computed."""
    return bool(model.n_expert) and model.name.startswith("synthetic-") and model.name.endswith("-text")


def computed(model: Model, text: str | list[int], max_tokens: int = MAX_TOKENS, source: str = "") -> Trace:
    """A synthetic file with "text" routing (gguf/synth.py): its trace worked out from its weights instead of run
    (by_code). Its routers read only the route's dimensions, which only the embedding writes, so at every layer a
    token's experts are the top n_used of the router's rows against the token's code (the normalization before the
    router scales the code, which the order ignores; the routers' biases are zero): the same at any position and
    after any context, up to near ties the kernels' rounding may order otherwise. What `measure` gives
    (tests/test_routing.py compares the two), for a file too large to run a prompt through here: gpt-oss-120b's
    shape would read all of its 63 GB a ubatch."""
    from flexoffload.runtime import engine

    if not computable(model):
        raise FlexoffloadError(f"{model.path.name} is not a synthetic mixture of experts routed by the token")
    with engine.vocabulary(str(model.path)) as (lib, vocab):
        tokens = (engine.tokenize(lib, vocab, text) if isinstance(text, str) else list(text))[:max_tokens]
    return Trace(model.n_layer, model.n_expert, model.n_expert_used, by_code(model, tokens),
                 (f"{source}, " if source else "") + f"{len(tokens)} tokens, computed from the weights")


def by_code(model: Model, tokens: list[int]) -> np.ndarray:
    """tokens x layers x used: the experts each layer's router ranks first over the token's embedding alone (the
    route's dimensions of gguf/synth.py), from the file's weights, whatever its routing."""
    import gguf

    from flexoffload.gguf import synth

    reader = gguf.GGUFReader(str(model.path))
    by_name = {t.name: t for t in reader.tensors}
    route = synth.route_dims(model.n_embd)
    embd = by_name["token_embd.weight"]
    rows = np.asarray(embd.data)[np.asarray(tokens, dtype=np.int64)]
    if embd.tensor_type == gguf.GGMLQuantizationType.F32:
        codes = rows[:, -route:].astype(np.float32)
    else:  # the route's dimensions are whole blocks at each row's end
        block_size, type_size = gguf.GGML_QUANT_SIZES[embd.tensor_type]
        codes = gguf.quants.dequantize(rows[:, -route // block_size * type_size:], embd.tensor_type)
    ids = np.empty((len(tokens), model.n_layer, model.n_expert_used), dtype=np.int32)
    for il in range(model.n_layer):
        router = np.asarray(by_name[f"blk.{il}.ffn_gate_inp.weight"].data, dtype=np.float32)[:, -route:]
        ids[:, il] = np.argsort(-(codes @ router.T), axis=1, kind="stable")[:, :model.n_expert_used]
    return ids


def ubatch_ids(model: Model, ids: dict[int, np.ndarray], n_tokens: int) -> np.ndarray:
    """One ubatch's ids as tokens x layers x used, checked to be every layer's, every token's."""
    want = (n_tokens, model.n_expert_used)
    missing = [layer for layer in range(model.n_layer) if layer not in ids]
    if missing:
        raise FlexoffloadError(f"llama.cpp showed no expert choice (ffn_moe_topk) for layer {missing[0]} of "
                               f"{model.path.name}: its graph does not route as build_moe_ffn does")
    wrong = [layer for layer in range(model.n_layer) if ids[layer].shape != want]
    if wrong:
        got = ids[wrong[0]].shape
        raise FlexoffloadError(f"layer {wrong[0]}'s expert choice is {got[1]} experts for {got[0]} tokens, not "
                               f"{want[1]} for {want[0]}")
    return np.stack([ids[layer] for layer in range(model.n_layer)], axis=1)


def cache_path(model: Model, text: str | list[int], max_tokens: int, n_ctx: int, n_ubatch: int):
    what = text if isinstance(text, str) else " ".join(map(str, text))
    key = content_key(what, str(max_tokens), str(n_ctx), str(n_ubatch), VERSION)
    return cache_dir() / "profiles" / f"{file_key(model.path)}-experts-{key}.json"


def cached(model: Model) -> Trace | None:
    """The calibration text's trace if `profile --experts` (or a plan) measured it already, else None."""
    path = cache_path(model, calibration_text(), MAX_TOKENS, CTX, UBATCH)
    return Trace.read(path) if path.is_file() else None


def trace(model: Model, text: str | list[int] | None = None, n_threads: int | None = None,
          max_tokens: int = MAX_TOKENS, n_ctx: int = CTX, n_ubatch: int = UBATCH, remeasure: bool = False) -> Trace:
    """The experts the first max_tokens tokens of a text (or a list of its tokens; None: the HumanEval tuning
    problems) route to, measured once and cached per model file and text."""
    default = text is None
    text = calibration_text() if default else text
    path = cache_path(model, text, max_tokens, n_ctx, n_ubatch)
    if path.is_file() and not remeasure:
        return Trace.read(path)
    log.info("tracing which experts up to %d tokens of text route to in %s (once, cached; `flexoffload profile "
             "--experts -m %s` does it ahead): as long as a prompt of that many tokens with the file mapped (%.1f GB "
             "read where it is not in memory); it says how long to go as it goes", max_tokens, model.path.name,
             model.path, model.file_size / 1e9)
    what = "HumanEval 0-39 with solutions" if default else "a text"
    if computable(model) and profiler.too_large(model.file_size):
        # a prompt through it under mmap would read the whole file a ubatch: its routing is worked out instead
        result = computed(model, text, max_tokens, source=f"{model.path.name}: {what}")
        write_atomic(path, json.dumps(result.to_dict()))
        return result
    result = measure(model, text, n_threads or os.cpu_count() or 1, max_tokens, n_ctx, n_ubatch,
                     source=f"{model.path.name}: {what}")
    write_atomic(path, json.dumps(result.to_dict()))
    return result
