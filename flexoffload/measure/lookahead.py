"""Lookahead (issue 42, item 3): how well layer l's hidden state predicts the experts of layer l+1 (and l+2), measured
on text. The runtime acts on the prediction one layer ahead (patch 0029, the plan's `lookahead`); the plan's cost
counts the share of a layer's misses it hides by the recall measured here on the calibration text (recall_cached).

The prediction is Pre-gated MoE's and ProMoE's: the input layer l's router reads (the FFN's input after its norm),
put through layer l+d's router, its top k the experts layer l+d is predicted to route to. llama.cpp names the
router's product `ffn_moe_logits-<layer>` (build_moe_ffn: mul_mat(ffn_gate_inp, cur)); the recorder asks for it and
reads its second source, the router's input, whatever the architecture's graph names it (qwen2moe and qwen3moe:
`ffn_norm`, glm4moe: `post_attn_norm`), so the input is the one the router multiplies and not a guess by name.
Each prediction is made in the callback and only its ids are kept. The routed ids themselves are tracing's
(`ffn_moe_topk`), by the same recorder.

That input carries layer l's norm weight (rms_norm(h) * w_l), where layer l+d's router is trained on its own
(rms_norm(h') * w_{l+d}). Where the input is a norm's output times a weight of its layer (the node a MUL by
`blk.<l>.*norm.weight`), the prediction is also made with the weight swapped, x / w_l * w_{l+d}: layer l's hidden
state through layer l+d's norm and router (`renormed`). With norm weights of ones (the synthetic files) the two are
the same.

A router chooses the top k of gating(logits + ffn_gate_inp.bias) + exp_probs_b. Every gating function llama.cpp has
is monotone, so without exp_probs_b the choice is the top k of the logits; with it (glm4moe, DeepSeek V3) the
gating is the file's `expert_gating_func`, sigmoid where it names none. Grouped selection is not modelled (refused).
The layer's own router on its own input (distance 0) is kept too: it must give back the routed experts, a check
that the input and the weights are the ones llama.cpp used. Where it does not, the cause may be llama.cpp's own
rounding: it sorts the gated scores in F32 (softmax probabilities near 1/n_expert where the logits are tiny), equal
scores fall in its sort's order, and no prediction from the logits can follow that; the share of tokens whose k-th
and k+1-th scores are equal (`tied`) is counted from the sort's input (the `ffn_moe_argsort` node's source).

Recall against two baselines that need no router: the previous token's experts at the same layer (a cache's
bet), and the same token's experts at the layer before (meaningful only where expert ids mean the same thing from
one layer to the next, which nothing in a trained or constructed MoE makes them: on the test bed it is chance).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
from dataclasses import dataclass, field

import numpy as np

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, content_key, file_key, write_atomic
from flexoffload.gguf.model import Model, metadata
from flexoffload.measure import tracing

log = logging.getLogger(__name__)

LOGITS = b"ffn_moe_logits-"
ARGSORT = b"ffn_moe_argsort-"  # the sort the top k is a view of; its source: the scores llama.cpp chooses by
DISTANCES = (1, 2)  # layers ahead a layer's router input predicts
MAX_TOKENS = 1024

# struct ggml_tensor in the pinned ggml.h: type (4, padded to 8), buffer (8), ne (4 x 8), nb (4 x 8), op (4),
# op_params (64), flags (4), src (10 x 8), ...
_OFFSET_NE = 16
_OFFSET_OP = 8 + 8 + 32 + 32
_OFFSET_SRC = 8 + 8 + 32 + 32 + 4 + 64 + 4
_GGML_TYPE_F32 = 0

# llama_expert_gating_func_type
SOFTMAX, SIGMOID, SOFTMAX_WEIGHT, SQRT_SOFTPLUS = 1, 2, 3, 4

COLUMNS = ("recall_next", "recall_next2", "recall_next_renormed", "recall_next2_renormed", "recall_prev_token",
           "recall_same_token_prev_layer", "recall_own_router", "tied")

@dataclass(frozen=True)
class Router:
    """One layer's router as llama.cpp applies it: which k experts an input (tokens x n_embd) routes to."""
    weight: np.ndarray  # n_expert x n_embd, float32
    k: int
    logit_bias: np.ndarray | None = None  # ffn_gate_inp.bias, added to the logits
    selection_bias: np.ndarray | None = None  # exp_probs_b, added to the gated probabilities to choose
    gating: int = SOFTMAX

    def choose(self, x: np.ndarray) -> np.ndarray:
        """The top k experts of each row of x, tokens x k int32 (in no particular order)."""
        scores = x @ self.weight.T
        if self.logit_bias is not None:
            scores += self.logit_bias
        if self.selection_bias is not None:  # otherwise any gating keeps the logits' order
            scores = scores.astype(np.float64)  # no ties of saturated float32 sigmoids of our own
            if self.gating == SOFTMAX:
                scores = np.exp(scores - scores.max(axis=1, keepdims=True))
                scores /= scores.sum(axis=1, keepdims=True)
            elif self.gating == SIGMOID:
                scores = 0.5 * (1 + np.tanh(0.5 * scores))
            elif self.gating == SQRT_SOFTPLUS:
                scores = np.sqrt(np.logaddexp(0, scores))
            scores = scores + self.selection_bias
        return np.argpartition(-scores, self.k - 1, axis=1)[:, :self.k].astype(np.int32)


def _tensor(model: Model, name: str) -> np.ndarray | None:
    """A tensor of the file as float32 in numpy order (ggml's shape reversed), None if the file has no such tensor:
    the gguf package's reader and dequantize, as measure/layerstudy.py reads weights."""
    import gguf

    t = _tensors(str(model.path)).get(name)
    return None if t is None else gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)


@functools.lru_cache(maxsize=2)
def _tensors(path: str) -> dict:
    """The file's tensors by name (memory-mapped: read where used), once per file."""
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def routers(model: Model) -> list[Router]:
    """Every layer's router, read from the file."""
    if not model.n_expert:
        raise FlexoffloadError(f"{model.path.name} is not a mixture of experts: it has no routers to look ahead with")
    kv = metadata(model.path)
    if (kv.get(f"{model.arch}.expert_group_count") or 0) > 1:
        raise FlexoffloadError(f"{model.path.name} chooses its experts by group, which lookahead does not model")
    gating = kv.get(f"{model.arch}.expert_gating_func") or SIGMOID  # asked only where there is an exp_probs_b
    out = []
    for layer in range(model.n_layer):
        weight = _tensor(model, f"blk.{layer}.ffn_gate_inp.weight")
        if weight is None:
            raise FlexoffloadError(f"layer {layer} of {model.path.name} has no router (ffn_gate_inp): lookahead "
                                   f"needs every layer routed")
        out.append(Router(weight, model.n_expert_used, _tensor(model, f"blk.{layer}.ffn_gate_inp.bias"),
                          _tensor(model, f"blk.{layer}.exp_probs_b.bias"), int(gating)))
    return out


class _Recorder(tracing.Recorder):
    """tracing's recorder (each layer's routed ids, by layer), and at each router's product the ids layers l, l+1,
    l+2 would route to from layer l's router input: predicted[(distance, target layer)], tokens x k, and with the
    norm weight swapped for the target layer's: renormed[(distance, target layer)]."""

    def __init__(self, base, model: Model, layer_routers: list[Router], distances: tuple[int, ...]):
        super().__init__(base)
        self.model = model
        self.routers = layer_routers
        self.distances = (0, *distances)
        self.predicted: dict[tuple[int, int], np.ndarray] = {}
        self.renormed: dict[tuple[int, int], np.ndarray] = {}
        self.input_names: set[str] = set()
        self.norm_names: set[str] = set()
        self.norms: dict[str, np.ndarray | None] = {}  # norm weights read so far, by tensor name
        self.tied: dict[int, np.ndarray] = {}  # by layer, each token's k-th and k+1-th scores equal

    def clear(self) -> None:
        super().clear()
        self.predicted.clear()
        self.renormed.clear()
        self.tied.clear()

    def __call__(self, t, ask, user_data) -> bool:
        name = self.base.ggml_get_name(t)
        kind = LOGITS if name.startswith(LOGITS) else ARGSORT if name.startswith(ARGSORT) else None
        if kind is None:
            return super().__call__(t, ask, user_data)
        if ask:
            return True
        try:
            (self._predict if kind == LOGITS else self._count_ties)(t, int(name[len(kind):]))
        except Exception as e:  # kept for the decode's caller: ctypes would only print it
            self.error = self.error or e
        return True

    def _count_ties(self, argsort: int, layer: int) -> None:
        scores = self._f32(ctypes.c_void_p.from_address(argsort + _OFFSET_SRC).value, f"layer {layer}'s expert scores")
        k = self.routers[layer].k
        if k >= scores.shape[1]:
            self.tied[layer] = np.zeros(scores.shape[0], dtype=bool)
            return
        top = -np.partition(-scores, (k - 1, k), axis=1)
        self.tied[layer] = top[:, k - 1] == top[:, k]

    def _f32(self, t: int, what: str) -> np.ndarray:
        """A contiguous 2-D F32 node copied out, rows x ne[0]."""
        ne = (ctypes.c_int64 * 4).from_address(t + _OFFSET_NE)
        out = np.empty((ne[1], ne[0]), dtype=np.float32)
        if (ctypes.c_int.from_address(t).value != _GGML_TYPE_F32 or ne[2] != 1 or ne[3] != 1
                or self.base.ggml_nbytes(t) != out.nbytes):
            raise FlexoffloadError(f"{what} is not a contiguous 2-D F32 tensor")
        self.base.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
        return out

    def _predict(self, logits: int, layer: int) -> None:
        x, norm = self._router_input(logits, layer)
        own = self._norm(f"blk.{layer}.{norm}") if norm else None
        unweighted = np.divide(x, own, out=np.zeros_like(x), where=own != 0) if own is not None else None
        for d in self.distances:
            target = layer + d
            if target >= len(self.routers):
                continue
            self.predicted[(d, target)] = self.routers[target].choose(x)
            theirs = self._norm(f"blk.{target}.{norm}") if d and unweighted is not None else None
            if theirs is not None:
                self.renormed[(d, target)] = self.routers[target].choose(unweighted * theirs)

    def _router_input(self, logits: int, layer: int) -> tuple[np.ndarray, str | None]:
        """The router product's second source, tokens x n_embd, checked to be multiplied by this layer's router,
        and the name of the norm weight it is the product with (`ffn_norm.weight`), if it is one of this layer's."""
        weight, x = (ctypes.c_void_p * 2).from_address(logits + _OFFSET_SRC)
        got = self.base.ggml_get_name(weight).decode() if weight else ""
        if got != f"blk.{layer}.ffn_gate_inp.weight":
            raise FlexoffloadError(f"ffn_moe_logits-{layer} multiplies {got or 'nothing'}, not layer {layer}'s router")
        out = self._f32(x, f"layer {layer}'s router input")
        self.input_names.add(self.base.ggml_get_name(x).decode().rpartition("-")[0])
        norm = None
        if self.base.ggml_op_name(ctypes.c_int.from_address(x + _OFFSET_OP).value) == b"MUL":
            second = ctypes.c_void_p.from_address(x + _OFFSET_SRC + 8).value
            name = self.base.ggml_get_name(second).decode() if second else ""
            prefix = f"blk.{layer}."
            if name.startswith(prefix) and name.endswith("norm.weight"):
                norm = name[len(prefix):]
                self.norm_names.add(norm)
        return out, norm

    def _norm(self, name: str) -> np.ndarray | None:
        if name not in self.norms:
            self.norms[name] = _tensor(self.model, name)
        return self.norms[name]


@dataclass(frozen=True)
class Lookahead:
    """Each token's experts in every layer as routed, and as predicted from the router input `d` layers before:
    tokens x layers x k, -1 where a layer has no layer d before it. predicted[0] is each layer's own router on its
    own input (the check); renormed[d] the same input with the target layer's norm weight for layer l's (none where
    the input is not a weighted norm's output)."""
    actual: np.ndarray
    predicted: dict[int, np.ndarray] = field(default_factory=dict)
    renormed: dict[int, np.ndarray] = field(default_factory=dict)
    tied: np.ndarray | None = None  # tokens x layers: the k-th and k+1-th scores llama.cpp sorted were equal
    router_input: str = ""  # the graph's name of the node the routers read (without its layer)
    norm_weight: str = ""  # the norm weight that node is the product with (without its layer), if any
    source: str = ""

    @property
    def n_tokens(self) -> int:
        return self.actual.shape[0]


def measure(model: Model, text: str | list[int], n_threads: int, max_tokens: int = MAX_TOKENS,
            n_ctx: int = tracing.CTX, n_ubatch: int = tracing.UBATCH, distances: tuple[int, ...] = DISTANCES,
            source: str = "") -> Lookahead:
    """Decode the text (or its tokens) in this process (mmap) as tracing.measure does, its first max_tokens tokens,
    and record each one's routed experts and the experts predicted `distances` layers ahead."""
    from flexoffload import native

    recorder = _Recorder(native.graph_tensors(), model, routers(model), tuple(distances))
    actual, tied, predicted, renormed = [], [], {d: [] for d in recorder.distances}, {d: [] for d in distances}
    for n in tracing.decode(model, text, n_threads, recorder, "looking ahead", max_tokens, n_ctx, n_ubatch):
        actual.append(tracing.ubatch_ids(model, recorder.ids, n))
        tied.append(_ubatch_tied(model, recorder.tied, n))
        for d in recorder.distances:
            predicted[d].append(_ubatch_predicted(model, recorder.predicted, d, n))
        for d in distances:
            if recorder.renormed:
                renormed[d].append(_ubatch_predicted(model, recorder.renormed, d, n, required=False))
    what = f"{sum(len(a) for a in actual)} tokens"
    n_ubatches = len(actual)
    return Lookahead(np.concatenate(actual), {d: np.concatenate(p) for d, p in predicted.items()},
                     {d: np.concatenate(p) for d, p in renormed.items() if len(p) == n_ubatches}, np.concatenate(tied),
                     ",".join(sorted(recorder.input_names)), ",".join(sorted(recorder.norm_names)),
                     f"{source}, {what}" if source else what)


def _ubatch_predicted(model: Model, predicted: dict[tuple[int, int], np.ndarray], distance: int, n_tokens: int,
                      required: bool = True) -> np.ndarray:
    """One ubatch's predictions from `distance` layers before, tokens x layers x k, -1 for the first layers (and,
    not required, where a layer has none)."""
    out = np.full((n_tokens, model.n_layer, model.n_expert_used), -1, dtype=np.int32)
    for target in range(distance, model.n_layer):
        ids = predicted.get((distance, target))
        if ids is not None:
            out[:, target] = ids
        elif required:
            raise FlexoffloadError(f"llama.cpp showed no router product (ffn_moe_logits) for layer "
                                   f"{target - distance} of {model.path.name}")
    return out


def _ubatch_tied(model: Model, tied: dict[int, np.ndarray], n_tokens: int) -> np.ndarray:
    """One ubatch's ties, tokens x layers."""
    missing = [layer for layer in range(model.n_layer) if layer not in tied]
    if missing:
        raise FlexoffloadError(f"llama.cpp showed no expert sort (ffn_moe_argsort) for layer {missing[0]} of "
                               f"{model.path.name}")
    return np.stack([tied[layer] for layer in range(model.n_layer)], axis=1)


def recall(predicted: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """|predicted & actual| / k for each set of k ids on the last axis (the predicted ones distinct); NaN where the
    prediction is missing (all -1)."""
    hits = (predicted[..., :, None] == actual[..., None, :]).any(axis=-1).sum(axis=-1)
    out = hits / actual.shape[-1]
    return np.where((predicted < 0).all(axis=-1), np.nan, out)


def by_layer(result: Lookahead) -> list[dict]:
    """Per layer from the second on, the mean recall over the tokens of: the prediction from one and two layers
    before (`recall_next`, `recall_next2`; `_renormed`: with the target layer's norm weight), the previous token's
    experts at this layer, this token's at the layer before, this layer's own router (the check), and the share of
    tokens whose k-th and k+1-th scores llama.cpp sorted were equal (`tied`). NaN where a column has no value (next2
    at layer 1, renormed where the input is no weighted norm's)."""
    actual = result.actual
    n_layer = actual.shape[1]
    empty = np.full(actual.shape[:1], np.nan)

    def mean(values: np.ndarray) -> float:
        return float(np.nanmean(values)) if np.isfinite(values).any() else float("nan")

    def ahead(d: int, layer: int, predicted: dict[int, np.ndarray]) -> np.ndarray:
        return recall(predicted[d][:, layer], actual[:, layer]) if d in predicted else empty

    rows = []
    for layer in range(1, n_layer):
        rows.append({"layer": layer,
                     "recall_next": mean(ahead(1, layer, result.predicted)),
                     "recall_next2": mean(ahead(2, layer, result.predicted)),
                     "recall_next_renormed": mean(ahead(1, layer, result.renormed)),
                     "recall_next2_renormed": mean(ahead(2, layer, result.renormed)),
                     "recall_prev_token": mean(recall(actual[:-1, layer], actual[1:, layer])),
                     "recall_same_token_prev_layer": mean(recall(actual[:, layer - 1], actual[:, layer])),
                     "recall_own_router": mean(ahead(0, layer, result.predicted)),
                     "tied": mean(result.tied[:, layer].astype(float)) if result.tied is not None else float("nan")})
    return rows


def means(rows: list[dict]) -> dict[str, float]:
    """Each column's mean over the layers that have it."""
    out = {}
    for column in COLUMNS:
        values = [r[column] for r in rows if np.isfinite(r[column])]
        out[column] = float(np.mean(values)) if values else float("nan")
    return out


def _recall_path(model: Model):
    key = content_key(tracing.calibration_text(), str(MAX_TOKENS), str(tracing.CTX), str(tracing.UBATCH), "v1")
    return cache_dir() / "profiles" / f"{file_key(model.path)}-lookahead-{key}.json"


def recall_cached(model: Model) -> tuple[float, ...] | None:
    """By layer, the share of its routed experts the layer before's router input predicts through its router (the
    runtime's prediction, patch 0029: no norm swapped; layer 0: none), on the calibration text's first MAX_TOKENS
    tokens, if `profile --experts` measured it; else None."""
    path = _recall_path(model)
    return tuple(json.loads(path.read_text())["recall_next"]) if path.is_file() else None


def recall_by_layer(model: Model, n_threads: int | None = None, remeasure: bool = False) -> tuple[float, ...]:
    """recall_cached's numbers, measured once (a decode of MAX_TOKENS tokens in this process, with the file mapped)
    and cached per model file."""
    path = _recall_path(model)
    if path.is_file() and not remeasure:
        return recall_cached(model)
    log.info("measuring how well each layer predicts the next one's experts on %d tokens of the calibration text "
             "(once, cached): about as long as tracing them", MAX_TOKENS)
    result = measure(model, tracing.calibration_text(), n_threads or os.cpu_count() or 1,
                     source=f"{model.path.name}: HumanEval 0-39 with solutions")
    rows = {r["layer"]: r["recall_next"] for r in by_layer(result)}
    recall = tuple(float(rows[il]) if il in rows and np.isfinite(rows[il]) else 0.0 for il in range(model.n_layer))
    write_atomic(path, json.dumps({"recall_next": recall, "tokens": result.n_tokens, "source": result.source}))
    return recall
