"""How much of a dense SwiGLU FFN a token needs, read in groups of neurons (issue 31: M2Cache's predicted active
neurons, Deja Vu's predictor, CATS/TEAL's gate threshold), measured on a calibration capture (coactivation.collect).

A neuron i is row i of ffn_gate and ffn_up and column i of ffn_down; its contribution to a token is
|h_i| * ||down[:, i]|| (coactivation.contributions). The runtime reads neurons the way the MoE test bed reads experts
(docs/moe-testbed.md): a group of G neurons is one expert, the hot set (always read) the shared expert, a predictor the
router. Here, per layer and in numpy only:

- layouts: the neurons hot-first (by mean contribution on the fit tokens) cut into groups of G consecutive ones, or
  co-activation groups (coactivation.coactive_groups, as split() makes experts); the first n_hot neurons of the
  hot-first order are the hot set in both;
- predictors of a group's contribution mass on a token: "linear" (ridge least squares from the FFN input x, as the
  test bed's router; optionally reduced to rank r, Deja Vu's low-rank predictor), "gate" (CATS: gate x computed in
  full, a group scored by its neurons' |silu(gate x)| times their typical |up x| * ||down||: costs all of ffn_gate),
  "oracle" (the true mass: the bound), "static" (a group's mean mass on the fit tokens: the same groups for every
  token, i.e. a bigger hot set, the baseline a predictor must beat);
- selections: the top k groups (glm4moe's fixed k) for a target share of bytes, or a threshold on the predicted share
  of a token's mass chosen on the fit tokens so that a target share of the groups the token needs is kept
  (recall first);
- metrics on held-out tokens: bytes read (the hot set counted), recall, mass kept, and the FFN output's relative
  error ||W_down (h * mask) - W_down h|| / ||W_down h||.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexoffload import FlexoffloadError
from flexoffload.measure import coactivation

if TYPE_CHECKING:
    import numpy as np

# Bytes of one neuron in the side file the runtime reads (issue 31 item 1): gate and up rows as the dense file stores
# them (Q4_K: 144 bytes per 256 values), down columns requantized to Q8_0 (34 bytes per 32), as moefy writes them.
GATE_UP_BLOCK = (256, 144)
DOWN_BLOCK = (32, 34)
NEEDED_MASS = 0.9  # recall counts the groups a token needs to hold this share of its routed mass
RIDGE = coactivation.RIDGE
PREDICTOR_BYTES = 4  # a linear predictor's weights as ffn_gate_inp holds them (F32)


@dataclass(frozen=True)
class NeuronBytes:
    """The bytes of one neuron in each FFN matrix."""
    gate: float
    up: float
    down: float

    @property
    def total(self) -> float:
        return self.gate + self.up + self.down


def neuron_bytes(n_embd: int) -> NeuronBytes:
    """One neuron's bytes: a Q4_K row of gate and of up, a Q8_0 column of down (n_embd values each)."""
    if n_embd % GATE_UP_BLOCK[0] or n_embd % DOWN_BLOCK[0]:
        raise FlexoffloadError(f"n_embd {n_embd} is not whole Q4_K and Q8_0 blocks")
    gate = n_embd // GATE_UP_BLOCK[0] * GATE_UP_BLOCK[1]
    return NeuronBytes(gate=gate, up=gate, down=n_embd // DOWN_BLOCK[0] * DOWN_BLOCK[1])


# --- layouts ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """One layer's neurons as a hot set (always read) and equal groups (read whole or not at all)."""
    name: str
    hot: np.ndarray  # (n_hot,) neuron indices
    groups: np.ndarray  # (n_groups, size) neuron indices

    @property
    def size(self) -> int:
        return self.groups.shape[1]

    @property
    def n_groups(self) -> int:
        return self.groups.shape[0]

    @property
    def n_ff(self) -> int:
        return self.hot.size + self.groups.size


def hot_first_order(contrib_fit: np.ndarray) -> np.ndarray:
    """The neurons by mean contribution on the fit tokens, largest first (a permutation of range(n_ff))."""
    import numpy as np

    return np.argsort(-contrib_fit.mean(axis=0), kind="stable")


def _check_sizes(n_ff: int, size: int, n_hot: int) -> None:
    if size < 1 or n_hot < 0 or n_hot > n_ff or (n_ff - n_hot) % size:
        raise FlexoffloadError(f"{n_ff} neurons less {n_hot} hot do not make groups of {size}")


def hot_first(contrib_fit: np.ndarray, size: int, n_hot: int) -> Layout:
    """Groups of size consecutive neurons of the hot-first order, the first n_hot of it the hot set."""
    order = hot_first_order(contrib_fit)
    _check_sizes(order.size, size, n_hot)
    return Layout("hot-first", hot=order[:n_hot], groups=order[n_hot:].reshape(-1, size))


def coactivated(contrib_fit: np.ndarray, size: int, n_hot: int, seed: int = 0) -> Layout:
    """Groups of size neurons that are active on the same tokens (balanced k-means on binary co-activation profiles,
    as coactivation.split makes experts), the hot set the first n_hot of the hot-first order."""
    import numpy as np

    order = hot_first_order(contrib_fit)
    _check_sizes(order.size, size, n_hot)
    routed = np.sort(order[n_hot:])
    groups = coactivation.coactive_groups(contrib_fit, routed, routed.size // size, seed)
    return Layout("coactivation", hot=order[:n_hot], groups=groups)


def group_mass(contrib: np.ndarray, layout: Layout) -> np.ndarray:
    """Each group's contribution mass on each token, (n_tokens, n_groups)."""
    return contrib[:, layout.groups].sum(axis=2)


# --- predictors ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Linear:
    """scores = x @ weights + bias, one column a group."""
    weights: np.ndarray  # (n_embd, n_groups)
    bias: np.ndarray  # (n_groups,)
    rank: int  # 0: full

    def scores(self, x: np.ndarray) -> np.ndarray:
        import numpy as np

        return x.astype(np.float32) @ self.weights + self.bias

    @property
    def n_params(self) -> int:
        n_embd, n_groups = self.weights.shape
        return (self.rank * (n_embd + n_groups) if self.rank else n_embd * n_groups) + n_groups


class Ridge:
    """Ridge least squares from x (n_tokens, n_embd) with an intercept, the ridge relative to the mean eigenvalue of
    the centred X'X; the inverse is computed once for any number of targets."""

    def __init__(self, x_fit: np.ndarray, ridge: float = RIDGE):
        import numpy as np

        x = x_fit.astype(np.float64)
        self.x_mean = x.mean(axis=0)
        self.xc = x - self.x_mean
        gram = self.xc.T @ self.xc
        gram += ridge * np.trace(gram) / gram.shape[0] * np.eye(gram.shape[0])
        self.inverse = np.linalg.inv(gram)

    def fit(self, target_fit: np.ndarray, rank: int = 0) -> Linear:
        """The predictor of target (n_tokens, n_groups). rank > 0: reduced-rank regression, the weights projected
        onto the top rank principal directions of the fitted scores (the best rank-r predictor in the fit's squared
        error; a plain SVD of the weights would ignore x's very unequal scales)."""
        import numpy as np

        y = target_fit.astype(np.float64)
        y_mean = y.mean(axis=0)
        weights = self.inverse @ (self.xc.T @ (y - y_mean))
        if rank and rank < min(weights.shape):
            if weights.shape[1] > weights.shape[0]:  # many outputs: the fitted scores' directions through xc = q r
                _, _, vt = np.linalg.svd(np.linalg.qr(self.xc, mode="r") @ weights, full_matrices=False)
            else:
                _, _, vt = np.linalg.svd(self.xc @ weights, full_matrices=False)
            weights = weights @ vt[:rank].T @ vt[:rank]
        else:
            rank = 0
        bias = y_mean - self.x_mean @ weights
        return Linear(weights=weights.astype(np.float32), bias=bias.astype(np.float32), rank=rank)


def fit_linear(x_fit: np.ndarray, target_fit: np.ndarray, rank: int = 0, ridge: float = RIDGE) -> Linear:
    """Ridge(x_fit, ridge).fit(target_fit, rank): the test bed's router (with an intercept), or Deja Vu's low-rank
    predictor."""
    return Ridge(x_fit, ridge).fit(target_fit, rank)


def silu(z: np.ndarray) -> np.ndarray:
    """z * sigmoid(z), the sigmoid through tanh (no overflow)."""
    import numpy as np

    return z * (0.5 + 0.5 * np.tanh(0.5 * z))


def gate_activation(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """silu(gate x) for each token, (n_tokens, n_ff); gate is ffn_gate's weights, (n_ff, n_embd)."""
    import numpy as np

    return silu(x.astype(np.float32) @ gate.astype(np.float32).T).astype(np.float32)


def gate_scale(gated_fit: np.ndarray, activations_fit: np.ndarray, norms: np.ndarray) -> np.ndarray:
    """Per neuron, what one unit of |silu(gate x)| is worth in contribution: the least-squares a_i in
    |h_i| ~ a_i |silu(gate_i x)| (a_i: the neuron's typical |up_i x|) times ||down[:, i]||."""
    import numpy as np

    s = np.abs(gated_fit.astype(np.float32))
    h = np.abs(activations_fit.astype(np.float32))
    return ((s * h).sum(axis=0) / np.maximum((s * s).sum(axis=0), 1e-30) * norms).astype(np.float32)


def gate_scores(gated: np.ndarray, scale: np.ndarray, layout: Layout) -> np.ndarray:
    """A group's predicted mass from silu(gate x): sum over its neurons of |silu(gate_i x)| * scale_i."""
    import numpy as np

    return (np.abs(gated) * scale)[:, layout.groups].sum(axis=2)


# --- selection ----------------------------------------------------------------------------------------------------

def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """The k groups of the largest score on each token, a (n_tokens, n_groups) bool mask."""
    import numpy as np

    mask = np.zeros(scores.shape, dtype=bool)
    if k >= scores.shape[1]:
        mask[:] = True
    elif k > 0:
        np.put_along_axis(mask, np.argpartition(-scores, k - 1, axis=1)[:, :k], True, axis=1)
    return mask


def needed(mass: np.ndarray, share: float = NEEDED_MASS) -> np.ndarray:
    """The fewest groups of each token that hold share of its mass (the largest first), a bool mask."""
    import numpy as np

    order = np.argsort(-mass, axis=1, kind="stable")
    ranked = np.take_along_axis(mass, order, axis=1)
    before = np.cumsum(ranked, axis=1) - ranked
    take = before < share * mass.sum(axis=1, keepdims=True)
    take[:, 0] = True
    mask = np.zeros(mass.shape, dtype=bool)
    np.put_along_axis(mask, order, take, axis=1)
    return mask


def shares(scores: np.ndarray) -> np.ndarray:
    """Scores as each token's share of its predicted mass (negative predictions count as none)."""
    import numpy as np

    s = np.maximum(scores, 0)
    return s / np.maximum(s.sum(axis=1, keepdims=True), 1e-30)


def recall_threshold(scores_fit: np.ndarray, needed_fit: np.ndarray, recall: float) -> float:
    """The threshold on shares(scores) that keeps the given share of the needed (token, group) pairs of the fit
    tokens."""
    import numpy as np

    kept = shares(scores_fit)[needed_fit]
    return float(np.quantile(kept, 1 - recall)) if kept.size else 0.0


def threshold(scores: np.ndarray, tau: float) -> np.ndarray:
    """The groups whose share of the token's predicted mass is at least tau."""
    return shares(scores) >= tau


# --- metrics ------------------------------------------------------------------------------------------------------

def bytes_share(mask: np.ndarray, layout: Layout, sizes: NeuronBytes, whole_gate: bool = False) -> float:
    """The mean share of the FFN's bytes a token reads: the hot set and its chosen groups in all three matrices, or,
    with whole_gate (the gate predictor), all of ffn_gate and the rest of the chosen in up and down."""
    read = layout.hot.size + mask.sum(axis=1).mean() * layout.size
    if whole_gate:
        return float((layout.n_ff * sizes.gate + read * (sizes.up + sizes.down)) / (layout.n_ff * sizes.total))
    return float(read / layout.n_ff)


def recall_of(mask: np.ndarray, needed_mask: np.ndarray) -> float:
    """The mean over tokens of the share of its needed groups chosen."""
    import numpy as np

    n = needed_mask.sum(axis=1)
    got = (mask & needed_mask).sum(axis=1)
    return float(np.where(n > 0, got / np.maximum(n, 1), 1.0).mean())


def mass_kept(mask: np.ndarray, mass: np.ndarray, hot_mass: np.ndarray, total: np.ndarray) -> float:
    """The mean share of a token's contribution mass in the hot set and its chosen groups."""
    return float(((hot_mass + (mass * mask).sum(axis=1)) / total).mean())


def relative_error(activations: np.ndarray, down: np.ndarray, neuron_mask: np.ndarray) -> np.ndarray:
    """Per token ||down (h * mask) - down h|| / ||down h|| (down: (n_embd, n_ff)); the direct way, for any mask."""
    import numpy as np

    h = activations.astype(np.float32)
    d = down.astype(np.float32)
    err = np.linalg.norm((h * ~neuron_mask) @ d.T, axis=1)
    return err / np.maximum(np.linalg.norm(h @ d.T, axis=1), 1e-30)


def relative_errors(activations: np.ndarray, down: np.ndarray, layout: Layout, masks: np.ndarray,
                    chunk_bytes: int = 1 << 28) -> np.ndarray:
    """relative_error for many group masks of one layout at once, (n_masks, n_tokens): each group's output on a token
    is computed once (down over its neurons), the error of a mask the norm of the sum of its dropped groups'
    outputs. masks: (n_masks, n_tokens, n_groups) bool; the hot set is never dropped."""
    import numpy as np

    h = activations.astype(np.float32)
    d = down.astype(np.float32)
    full = np.linalg.norm(h @ d.T, axis=1)
    if layout.size == 1:  # each group's output would be a full product per token: mask by mask instead
        out = np.empty(masks.shape[:2], dtype=np.float32)
        for m, mask in enumerate(masks):
            dropped = np.zeros(h.shape, dtype=np.float32)
            dropped[:, layout.groups[:, 0]] = h[:, layout.groups[:, 0]] * ~mask
            out[m] = np.linalg.norm(dropped @ d.T, axis=1)
        return out / np.maximum(full, 1e-30)
    dg = d.T[layout.groups]  # (n_groups, size, n_embd)
    n_embd = d.shape[0]
    step = max(1, chunk_bytes // (layout.n_groups * n_embd * 4))
    out = np.empty(masks.shape[:2], dtype=np.float32)
    for start in range(0, h.shape[0], step):
        rows = slice(start, min(start + step, h.shape[0]))
        hg = h[rows][:, layout.groups].transpose(1, 0, 2)  # (n_groups, t, size)
        y = np.matmul(hg, dg).transpose(1, 0, 2)  # (t, n_groups, n_embd): each group's output
        drop = (~masks[:, rows]).transpose(1, 0, 2).astype(np.float32)  # (t, n_masks, n_groups)
        out[:, rows] = np.linalg.norm(np.matmul(drop, y), axis=2).T
    return out / np.maximum(full, 1e-30)
