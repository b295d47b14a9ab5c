"""One layer's study of predicted neurons (issue 31; scripts/neurons_study): every layout, hot set, predictor rank
and selection of measure/neurons.py's building blocks, measured held out on one layer's calibration capture, and
the test bed's routed rows."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from flexoffload import FlexoffloadError
from flexoffload.measure import coactivation
from flexoffload.measure.neurons import (PREDICTOR_BYTES, Layout, Ridge, bytes_share, coactivated, gate_activation,
                                         gate_scale, gate_scores, group_mass, hot_first, mass_kept, needed,
                                         neuron_bytes, recall_of, recall_threshold, relative_errors, threshold,
                                         top_k)

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

KEPT_SHARES = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)  # top-k: target shares of the FFN's bytes
RECALLS = (0.9, 0.95, 0.99)  # threshold: target recall on the fit tokens
ORACLE_MASSES = (0.8, 0.9, 0.95, 0.99)  # the oracle's fewest groups holding this share of the routed mass


@dataclass(frozen=True)
class Row:
    """One configuration's held-out result on one layer."""
    layer: int
    layout: str
    G: int
    n_hot: int
    predictor: str
    rank: int
    selection: str  # "top-k", "threshold" (recall target), "needed" (oracle: fewest groups for a mass share)
    target: float  # top-k: the bytes share aimed at; threshold: the recall aimed at; needed: the mass share
    k: float  # groups read a token (mean)
    kept_bytes_share: float
    recall: float
    mass_kept: float
    rel_err: float
    predictor_share: float  # the linear predictor's F32 weights as a share of the FFN's bytes


@dataclass
class Study:
    """The grid of one layer's study. Groups of 1 (single neurons: the bound of grouping, CATS as published) get a
    linear predictor only at neuron_ranks (one per neuron is as big as the FFN) and no hot set (at neuron level the selection takes the
    hot neurons anyway), and are measured on every neuron_stride-th held-out token and their thresholds set on every
    neuron_stride-th fit token (their errors cost a full down product per mask); the others on every held_stride-th
    held-out token (neighbouring tokens are alike)."""
    groups: tuple[int, ...] = (1, 16, 32, 64, 128)
    hots: tuple[int, ...] = (0, 1024)
    ranks: tuple[int, ...] = (0, 128)  # linear predictors (0: full rank)
    kept_shares: tuple[float, ...] = KEPT_SHARES
    recalls: tuple[float, ...] = RECALLS
    oracle_masses: tuple[float, ...] = ORACLE_MASSES
    coactivation_min: int = 32  # co-activation layouts for groups at least this big (k-means takes longer for many)
    coactivation_hots: tuple[int, ...] = (1024,)  # ... and these hot sets (0: no hot set)
    neuron_stride: int = 4
    neuron_ranks: tuple[int, ...] = ()  # linear predictors for single neurons too (big: 18 % of the FFN at rank 128)
    held_stride: int = 2
    seed: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def _time(self, what: str, t0: float) -> None:
        self.timings[what] = self.timings.get(what, 0.0) + time.time() - t0

    def layer(self, il: int, inputs: np.ndarray, activations: np.ndarray, gate: np.ndarray,
              down: np.ndarray) -> list[Row]:
        """All configurations on one layer: inputs (T, n_embd), activations (T, n_ff), gate (n_ff, n_embd), down
        (n_embd, n_ff). Fit on the first 1 - HOLDOUT of the tokens, measured on the rest."""
        import numpy as np

        n_tokens, n_ff = activations.shape
        fit = np.arange(coactivation.n_fit(n_tokens))
        held = np.arange(fit.size, n_tokens)
        if not held.size:
            raise FlexoffloadError(f"{n_tokens} tokens leave none held out")
        t0 = time.time()
        h = activations.astype(np.float32)
        down = down.astype(np.float32)
        norms = np.linalg.norm(down, axis=0)
        contrib = coactivation.contributions(h, norms)
        gated = gate_activation(inputs, gate)
        scale = gate_scale(gated[fit], h[fit], norms)
        ridge = Ridge(inputs[fit])
        self._time("inputs", t0)
        data = dict(x=inputs, h=h, down=down, contrib=contrib, gated=gated, scale=scale, ridge=ridge,
                    sizes=neuron_bytes(inputs.shape[1]))
        rows = []
        for size in self.groups:
            for n_hot in ((0,) if size == 1 else self.hots):
                if (n_ff - n_hot) % size:
                    log.warning("layer %d: %d hot neurons leave no groups of %d: skipped", il, n_hot, size)
                    continue
                layouts = [hot_first(contrib[fit], size, n_hot)]
                if size >= max(self.coactivation_min, 2) and n_hot in self.coactivation_hots:
                    t0 = time.time()
                    layouts.append(coactivated(contrib[fit], size, n_hot, seed=self.seed))
                    self._time(f"k-means G={size}", t0)
                stride = self.neuron_stride if size == 1 else self.held_stride
                for layout in layouts:
                    rows += self._layout(il, layout, held=held[::stride], fit=fit[::stride if size == 1 else 1],
                                         fit_all=fit, **data)
        return rows

    def _layout(self, il, layout, *, x, h, down, contrib, gated, scale, ridge, sizes, fit, fit_all,
                held) -> list[Row]:
        import numpy as np

        t0 = time.time()
        mass = group_mass(contrib, layout)
        total = contrib[held].sum(axis=1)
        hot_mass = contrib[held][:, layout.hot].sum(axis=1)
        need_fit, need_held = needed(mass[fit]), needed(mass[held])
        ffn_bytes = layout.n_ff * sizes.total
        # (predictor, rank, scores over all tokens, reads all of ffn_gate, predictor's bytes share)
        predictors = [("oracle", 0, mass, False, 0.0),
                      ("static", 0, np.broadcast_to(mass[fit].mean(axis=0), mass.shape), False, 0.0)]
        # a linear predictor per neuron is as big as the FFN: only when asked for
        for rank in self.ranks if layout.size > 1 else self.neuron_ranks:
            model = ridge.fit(mass[fit_all], rank=rank)
            predictors.append(("linear", model.rank, model.scores(x), False,
                               model.n_params * PREDICTOR_BYTES / ffn_bytes))
        predictors.append(("gate", 0, gate_scores(gated, scale, layout), True, 0.0))
        self._time("predictors", t0)

        specs, masks = [], []
        gate_share = sizes.gate / sizes.total
        for name, rank, scores, whole_gate, cost in predictors:
            seen = set()
            for target in self.kept_shares:
                share = (target - gate_share) / (1 - gate_share) if whole_gate else target
                k = int(round((share * layout.n_ff - layout.hot.size) / layout.size))
                if k < 0 or k > layout.n_groups or k in seen:
                    continue
                seen.add(k)
                specs.append((name, rank, "top-k", target, whole_gate, cost))
                masks.append(top_k(scores[held], k))
            if name == "oracle":
                for m in self.oracle_masses:
                    specs.append((name, rank, "needed", m, whole_gate, cost))
                    masks.append(needed(mass[held], m))
            else:
                for r in self.recalls:
                    tau = recall_threshold(scores[fit], need_fit, r)
                    specs.append((name, rank, "threshold", r, whole_gate, cost))
                    masks.append(threshold(scores[held], tau))
        t0 = time.time()
        errors = relative_errors(h[held], down, layout, np.stack(masks)).mean(axis=1)
        self._time("errors", t0)
        rows = []
        for (name, rank, selection, target, whole_gate, cost), mask, err in zip(specs, masks, errors):
            rows.append(Row(layer=il, layout=layout.name, G=layout.size, n_hot=layout.hot.size, predictor=name,
                            rank=rank, selection=selection, target=target, k=float(mask.sum(axis=1).mean()),
                            kept_bytes_share=bytes_share(mask, layout, sizes, whole_gate),
                            recall=recall_of(mask, need_held),
                            mass_kept=mass_kept(mask, mass[held], hot_mass, total),
                            rel_err=float(err), predictor_share=cost))
        return rows


def routed_rows(il: int, inputs: np.ndarray, activations: np.ndarray, down: np.ndarray, layout: Layout,
                router: np.ndarray, used: tuple[int, ...], name: str = "router") -> list[Row]:
    """A given split (layout) and its router (n_groups, n_embd; a group's score router @ x) at each k of used, on the
    held-out tokens: what a built MoE file such as the test bed reads and errs."""
    import numpy as np

    n_tokens = activations.shape[0]
    held = np.arange(coactivation.n_fit(n_tokens), n_tokens)
    h = activations[held].astype(np.float32)
    down = down.astype(np.float32)
    contrib = coactivation.contributions(h, np.linalg.norm(down, axis=0))
    mass = group_mass(contrib, layout)
    total, hot_mass = contrib.sum(axis=1), contrib[:, layout.hot].sum(axis=1)
    scores = inputs[held].astype(np.float32) @ router.T.astype(np.float32)
    masks = np.stack([top_k(scores, k) for k in used])
    errors = relative_errors(h, down, layout, masks).mean(axis=1)
    sizes = neuron_bytes(inputs.shape[1])
    return [Row(layer=il, layout=layout.name, G=layout.size, n_hot=layout.hot.size, predictor=name, rank=0,
                selection="top-k", target=round((layout.hot.size + k * layout.size) / layout.n_ff, 4), k=float(k),
                kept_bytes_share=bytes_share(mask, layout, sizes), recall=recall_of(mask, needed(mass)),
                mass_kept=mass_kept(mask, mass, hot_mass, total), rel_err=float(err),
                predictor_share=router.size * PREDICTOR_BYTES / (layout.n_ff * sizes.total))
            for k, mask, err in zip(used, masks, errors)]


def ffn_weights(model_path: str, il: int, reader=None) -> tuple[np.ndarray, np.ndarray]:
    """Layer il's ffn_gate (n_ff, n_embd) and ffn_down (n_embd, n_ff) weights, dequantized, float32."""
    import gguf

    reader = reader or gguf.GGUFReader(model_path)
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for name in (f"blk.{il}.ffn_gate.weight", f"blk.{il}.ffn_down.weight"):
        if name not in tensors:
            raise FlexoffloadError(f"{model_path} has no {name}")
        t = tensors[name]
        out.append(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32"))
    return out[0], out[1]
