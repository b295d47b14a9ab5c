"""Which FFN neurons fire together on real text, and a mixture of experts made from that (MoEfication, Zhang et al.
2022, "MoEfication: Transformer Feed-forward Layers are Mixtures of Experts").

collect() runs a dense model over a calibration text through llama.cpp's eval callback and keeps, per layer, what
the FFN reads (ffn_norm's output, x) and its activation (the input to ffn_down, h = silu(gate x) * up x). split()
turns them into a layer's experts:

- a neuron's contribution to a token is |h_i| * ||down[:, i]||: what it adds to the FFN's output;
- the shared expert is the n_shared neurons with the largest mean contribution (the always-busy ones: every token
  reads them, so they are not worth routing);
- the rest are clustered into equal-size experts by balanced k-means on their co-activation profiles: a neuron is
  active on a token when it is in the token's top quarter by contribution (MoEfication's co-activation, binary), its
  profile the unit vector of the tokens it is active on, so neurons active on the same tokens fall in one expert
  (measured on the 1.5B, this holds more of a token's mass in its best experts than clustering the contributions
  themselves, their squares, or the gate rows);
- the router scores an expert by a ridge least-squares fit of the expert's total contribution from x (MoEfication's
  router predicts the same thing with a small MLP; one linear layer is what llama.cpp's ffn_gate_inp can hold).

The expert layout and the router go to gguf/moefy.py, which writes the file.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexoffload import FlexoffloadError
from flexoffload.gguf.moefy import LayerSplit

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

# struct ggml_tensor in the pinned ggml.h: type (4, padded to 8), buffer (8), ne (4 x int64), ...
_OFFSET_NE = 16
_GGML_TYPE_F32 = 0
INPUT = "ffn_norm"  # llama.cpp's names of the nodes read (qwen2, llama: build_norm then build_ffn), "-<layer>" added
ACTIVATION = "ffn_swiglu"


@dataclass
class Capture:
    """Per layer, one row per calibration token: what the FFN reads and its activation (the input to ffn_down)."""
    inputs: list[np.ndarray]  # (n_tokens, n_embd)
    activations: list[np.ndarray]  # (n_tokens, n_ff)

    @property
    def n_tokens(self) -> int:
        return self.inputs[0].shape[0] if self.inputs else 0


class _Recorder:
    """The eval callback: asks for the FFN's input and activation nodes, copies each out as it is computed."""

    def __init__(self, base, n_layer: int, dtype):
        self.base = base
        self.dtype = dtype
        self.rows: dict[tuple[str, int], list] = {}
        self.n_layer = n_layer

    def _wanted(self, name: str) -> tuple[str, int] | None:
        kind, _, layer = name.rpartition("-")
        if kind in (INPUT, ACTIVATION) and layer.isdigit():
            return kind, int(layer)
        return None

    def __call__(self, t, ask, _user_data) -> bool:
        import numpy as np

        key = self._wanted(self.base.ggml_get_name(t).decode())
        if ask:
            return key is not None
        if key is None:
            return True
        ne = (ctypes.c_int64 * 4).from_address(t + _OFFSET_NE)
        if ctypes.c_int.from_address(t).value != _GGML_TYPE_F32 or ne[2] != 1 or ne[3] != 1:
            raise FlexoffloadError(f"node {key[0]}-{key[1]} is not a 2-D F32 tensor")
        out = np.empty((ne[1], ne[0]), dtype=np.float32)
        if self.base.ggml_nbytes(t) != out.nbytes:
            raise FlexoffloadError(f"node {key[0]}-{key[1]} is not contiguous")
        self.base.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
        self.rows.setdefault(key, []).append(out.astype(self.dtype, copy=False))
        return True


def collect(model_path: str, text: str, n_ctx: int = 512, max_tokens: int = 0, n_threads: int | None = None,
            dtype: str = "float16") -> Capture:
    """Run the dense model at model_path over text in chunks of n_ctx tokens (each from an empty cache) and keep every
    token's FFN input and activation, per layer. max_tokens: stop after that many (0: the whole text). Every token is
    an output, so the last layer, which llama.cpp computes for the outputs only, sees them all too."""
    import numpy as np

    from flexoffload import native
    from flexoffload.runtime import engine

    lib = native.llama_cpp()
    base = native.graph_tensors()
    settings = engine.Settings(n_ctx=n_ctx, n_batch=n_ctx, n_outputs=n_ctx, n_threads=n_threads or os.cpu_count() or 1,
                               strategy="mmap", temp=0)
    recorder = None
    callback = lib.ggml_backend_sched_eval_callback(lambda t, ask, data: recorder(t, ask, data))
    with engine.Engine(model_path, settings, eval_callback=callback) as eng:
        n_layer = lib.llama_model_n_layer(eng.model)
        recorder = _Recorder(base, n_layer, np.dtype(dtype))
        tokens = eng.tokenize(text, add_special=False)
        if max_tokens:
            tokens = tokens[:max_tokens]
        if not tokens:
            raise FlexoffloadError("the calibration text is empty")
        batch = lib.llama_batch_init(eng.n_batch, 0, 1)
        try:
            for start in range(0, len(tokens), eng.n_batch):
                chunk = tokens[start:start + eng.n_batch]
                lib.llama_memory_clear(lib.llama_get_memory(eng.ctx), True)
                batch.n_tokens = len(chunk)
                for i, token in enumerate(chunk):
                    batch.token[i] = token
                    batch.pos[i] = i
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = 0
                    batch.logits[i] = 1
                rc = lib.llama_decode(eng.ctx, batch)
                if rc != 0:
                    raise FlexoffloadError(f"llama_decode failed ({rc}) on the calibration text")
                log.info("co-activation: %d of %d tokens", start + len(chunk), len(tokens))
        finally:
            lib.llama_batch_free(batch)
    rows = recorder.rows
    missing = [f"{kind}-{il}" for il in range(n_layer) for kind in (INPUT, ACTIVATION) if (kind, il) not in rows]
    if missing:
        raise FlexoffloadError(f"{model_path} computed no {missing[0]} node: not a dense SwiGLU FFN llama.cpp names "
                               f"{INPUT}/{ACTIVATION}")
    capture = Capture(inputs=[], activations=[])
    for il in range(n_layer):  # chunk by chunk into one array a layer, the chunks let go as they are joined
        for kind, out in ((INPUT, capture.inputs), (ACTIVATION, capture.activations)):
            out.append(np.concatenate(rows.pop((kind, il))))
            if out[-1].shape[0] != len(tokens):
                raise FlexoffloadError(f"{kind}-{il}: {out[-1].shape[0]} rows recorded for {len(tokens)} tokens")
    return capture


# --- the split: shared expert, co-activation clusters, router ------------------------------------------------------

ACTIVE_SHARE = 0.25  # a neuron is active on a token when it is in the token's top quarter by contribution
RIDGE = 0.1  # the router fit's ridge, relative to the mean eigenvalue of X'X
HOLDOUT = 0.2  # the calibration tokens' last share: not fitted on, the split's quality is measured on it
ITERATIONS = 20  # balanced k-means rounds at most (it usually settles sooner)


@dataclass(frozen=True)
class SplitQuality:
    """What a token's routed experts and the shared one hold of the FFN's contribution mass (sum over neurons of
    |h_i| * ||down[:, i]||), on the held-out calibration tokens, for a number of experts used."""
    n_expert_used: int
    routed: float  # the router's choice
    oracle: float  # the k experts that hold the most (the clustering's bound)
    random: float  # the best k of experts made of random neurons (what clustering adds over no clustering)
    recall: float = 0.0  # of the k experts that hold the most, the share the router chose


def contributions(activations: np.ndarray, down_norms: np.ndarray) -> np.ndarray:
    """|h_i| * ||down[:, i]||: what neuron i adds to the FFN's output on each token (n_tokens, n_ff), float32."""
    import numpy as np

    return np.abs(activations.astype(np.float32)) * down_norms.astype(np.float32)


def down_norms(model_path: str, n_layer: int) -> list[np.ndarray]:
    """The norm of each ffn_down column (each neuron's output direction), per layer, from the file's weights."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(model_path)
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for il in range(n_layer):
        t = tensors[f"blk.{il}.ffn_down.weight"]
        out.append(np.linalg.norm(gguf.quants.dequantize(t.data, t.tensor_type), axis=0).astype(np.float32))
    return out


def balanced_kmeans(points: np.ndarray, k: int, iterations: int = ITERATIONS, seed: int = 0) -> np.ndarray:
    """Each row of points (unit vectors) in one of k clusters of equal size, by cosine k-means whose assignment
    fills clusters greedily: the points surest of their best cluster first, each to its most similar cluster with
    room left. Returns each point's cluster."""
    import numpy as np

    n = points.shape[0]
    if n % k:
        raise ValueError(f"{n} points do not make {k} clusters of equal size")
    size = n // k
    rng = np.random.default_rng(seed)
    centers = points[rng.choice(n, k, replace=False)].copy()
    assign = None
    for _ in range(iterations):
        sim = points @ centers.T
        preference = np.argsort(-sim, axis=1)
        room = np.full(k, size)
        new = np.empty(n, dtype=np.int64)
        for i in np.argsort(-sim.max(axis=1)):
            for c in preference[i]:
                if room[c]:
                    new[i] = c
                    room[c] -= 1
                    break
        if assign is not None and np.array_equal(new, assign):
            break
        assign = new
        for c in range(k):
            mean = points[assign == c].mean(axis=0)
            centers[c] = mean / (np.linalg.norm(mean) + 1e-12)
    return assign


def n_fit(n_tokens: int) -> int:
    """The calibration tokens fitted on: all but the last HOLDOUT (at least one)."""
    return max(int(n_tokens * (1 - HOLDOUT)), 1)


def coactive_groups(contrib_fit: np.ndarray, neurons: np.ndarray, n_groups: int, seed: int = 0) -> np.ndarray:
    """The neurons in n_groups equal groups of neurons that fire together, (n_groups, size): a neuron's profile is
    the fit tokens it is active on (in the token's top ACTIVE_SHARE by contribution), clustered by balanced k-means."""
    import numpy as np

    active = contrib_fit >= np.quantile(contrib_fit, 1 - ACTIVE_SHARE, axis=1, keepdims=True)
    profiles = active[:, neurons].T.astype(np.float32)
    profiles /= np.linalg.norm(profiles, axis=1, keepdims=True) + 1e-12
    assign = balanced_kmeans(profiles, n_groups, seed=seed)
    return np.stack([neurons[assign == g] for g in range(n_groups)])


def split(inputs: np.ndarray, activations: np.ndarray, norms: np.ndarray, n_expert: int, n_shared: int,
          used: tuple[int, ...] = (), seed: int = 0) -> tuple[LayerSplit, list[SplitQuality]]:
    """One layer's split from its calibration capture (inputs: (T, n_embd), activations: (T, n_ff)) and its ffn_down
    column norms: the shared expert (the n_shared neurons of the largest mean contribution), n_expert equal
    co-activation clusters of the rest, and a ridge least-squares router for them. The last HOLDOUT of the tokens is
    left out of the fit; with used (numbers of experts used), the split's quality on them, for each."""
    import numpy as np

    c = contributions(activations, norms)
    n_tokens, n_ff = c.shape
    fit = slice(0, n_fit(n_tokens))
    held = slice(fit.stop, n_tokens)
    if (n_ff - n_shared) % n_expert:
        raise FlexoffloadError(f"{n_ff} neurons less {n_shared} shared do not make {n_expert} equal experts")
    order = np.argsort(-c[fit].mean(axis=0), kind="stable")
    shared, routed = np.sort(order[:n_shared]), np.sort(order[n_shared:])

    experts = coactive_groups(c[fit], routed, n_expert, seed)

    # the router: an expert's score predicts its contribution mass from what the FFN reads
    mass = np.stack([c[fit][:, e].sum(axis=1) for e in experts], axis=1)  # (fit tokens, n_expert)
    x = inputs[fit].astype(np.float64)
    gram = x.T @ x
    gram += RIDGE * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
    weights = np.linalg.solve(gram, x.T @ mass)  # (n_embd, n_expert)
    scores = inputs.astype(np.float64) @ weights
    reach = float(np.abs(scores).max()) or 1.0
    router = (weights.T / reach).astype(np.float32)  # scores within +-1 on the calibration text (moefy's contract)
    layer = LayerSplit(shared=shared, experts=experts, router=router)
    return layer, (route_quality(layer, inputs[held], c[held], used, seed) if used else [])


def route_quality(layer: LayerSplit, inputs: np.ndarray, contrib: np.ndarray, used: tuple[int, ...],
                  seed: int = 0) -> list[SplitQuality]:
    """What a split holds on tokens it was not fitted on (inputs: (T, n_embd), contrib: their contributions
    (T, n_ff)), for each number of experts used: the share of a token's mass in the shared expert and the router's
    k, the best k, and the best k of random-neuron experts; and the router's recall of the best k."""
    import numpy as np

    if not len(contrib):
        return []
    scores = inputs.astype(np.float64) @ layer.router.T.astype(np.float64)
    total = contrib.sum(axis=1)
    base = contrib[:, layer.shared].sum(axis=1)
    mass = np.stack([contrib[:, e].sum(axis=1) for e in layer.experts], axis=1)  # (T, n_expert)
    routed = np.sort(layer.experts.ravel())
    scrambled = np.random.default_rng(seed).permutation(routed).reshape(layer.n_expert, -1)
    random_mass = np.stack([contrib[:, e].sum(axis=1) for e in scrambled], axis=1)
    quality = []
    for k in used:
        pick = np.argsort(-scores, axis=1)[:, :k]
        best = np.argsort(-mass, axis=1)[:, :k]
        routed_share = np.take_along_axis(mass, pick, axis=1).sum(axis=1)
        oracle_share = np.take_along_axis(mass, best, axis=1).sum(axis=1)
        random_share = -np.sort(-random_mass, axis=1)[:, :k].sum(axis=1)
        chosen = np.zeros_like(mass, dtype=bool)
        np.put_along_axis(chosen, pick, True, axis=1)
        recall = np.take_along_axis(chosen, best, axis=1).mean()
        quality.append(SplitQuality(k, float(((base + routed_share) / total).mean()),
                                    float(((base + oracle_share) / total).mean()),
                                    float(((base + random_share) / total).mean()), float(recall)))
    return quality
