"""measure/neurons.py on small synthetic arrays: the error and bytes of a layout's masks, the predictors against the
oracle, and a planted structure the linear predictor must find."""

import numpy as np
import pytest

from flexoffload.measure import layerstudy, neurons

N_EMBD = 256
N_FF = 512
G = 32


def planted(n_tokens=1200, noise=0.05, seed=0):
    """Tokens whose FFN activation is made of 16 groups of 32 neurons: group g's neurons fire together with an
    amplitude s_g * (1 + x . w_g) (a linear function of x, cut at 0; the groups' sizes s_g from 1 to 4), each neuron
    with its own sign and size. The groups are scattered over the neuron indices."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_tokens, N_EMBD)).astype(np.float32)
    n_groups = N_FF // G
    w = rng.standard_normal((N_EMBD, n_groups)).astype(np.float32) / np.sqrt(N_EMBD)
    amplitude = np.maximum(1 + x @ w, 0) * np.geomspace(1, 4, n_groups)  # (T, n_groups)
    groups = rng.permutation(N_FF).reshape(n_groups, G)
    weight = rng.choice([-1.0, 1.0], N_FF) * rng.uniform(0.5, 1.5, N_FF)
    h = np.empty((n_tokens, N_FF), dtype=np.float32)
    for g, members in enumerate(groups):
        h[:, members] = amplitude[:, [g]] * weight[members]
    h += noise * rng.standard_normal(h.shape).astype(np.float32)
    down = rng.standard_normal((N_EMBD, N_FF)).astype(np.float32)
    return x, h, down, neurons.Layout("planted", hot=np.array([], dtype=np.int64), groups=groups)


def test_full_mask_reads_everything_and_errs_nowhere():
    _, h, down, layout = planted(200)
    full = np.ones((1, 200, layout.n_groups), dtype=bool)
    assert np.abs(neurons.relative_errors(h, down, layout, full)).max() < 1e-5
    sizes = neurons.neuron_bytes(N_EMBD)
    assert neurons.bytes_share(full[0], layout, sizes) == pytest.approx(1.0)
    assert neurons.bytes_share(full[0], layout, sizes, whole_gate=True) == pytest.approx(1.0)
    none = np.zeros_like(full)
    assert neurons.relative_errors(h, down, layout, none) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("size", [1, 32])
def test_group_errors_match_the_direct_product(size):
    _, h, down, _ = planted(100)
    rng = np.random.default_rng(1)
    hot = rng.permutation(N_FF)
    layout = neurons.Layout("x", hot=hot[:64], groups=hot[64:].reshape(-1, size))
    masks = rng.random((3, 100, layout.n_groups)) < 0.5
    fast = neurons.relative_errors(h, down, layout, masks, chunk_bytes=1 << 20)  # several chunks
    for m, mask in enumerate(masks):
        neuron_mask = np.zeros((100, N_FF), dtype=bool)
        neuron_mask[:, layout.hot] = True
        for t in range(100):
            neuron_mask[t, layout.groups[mask[t]].ravel()] = True
        direct = neurons.relative_error(h, down, neuron_mask)
        assert direct.min() > 0.1
        np.testing.assert_allclose(fast[m], direct, rtol=1e-3, atol=1e-5)


def test_oracle_keeps_at_least_the_linear_predictors_mass():
    x, h, down, layout = planted(noise=0.3)
    contrib = np.abs(h) * np.linalg.norm(down, axis=0)
    mass = neurons.group_mass(contrib, layout)
    fit, held = slice(0, 1000), slice(1000, None)
    scores = neurons.fit_linear(x[fit], mass[fit]).scores(x[held])
    total = contrib[held].sum(axis=1)
    hot = np.zeros(total.shape)
    for k in range(1, layout.n_groups + 1):
        oracle = neurons.mass_kept(neurons.top_k(mass[held], k), mass[held], hot, total)
        linear = neurons.mass_kept(neurons.top_k(scores, k), mass[held], hot, total)
        assert oracle >= linear - 1e-9, k
    assert oracle == pytest.approx(1.0)


def test_linear_predictor_recovers_planted_groups():
    x, h, down, layout = planted()
    contrib = np.abs(h) * np.linalg.norm(down, axis=0)
    mass = neurons.group_mass(contrib, layout)
    fit, held = slice(0, 1000), slice(1000, None)
    need = neurons.needed(mass[held])
    k = int(np.quantile(need.sum(axis=1), 0.9))
    model = neurons.fit_linear(x[fit], mass[fit])
    assert neurons.recall_of(neurons.top_k(model.scores(x[held]), k), need) > 0.95
    low = neurons.fit_linear(x[fit], mass[fit], rank=8)
    assert low.rank == 8 and np.linalg.matrix_rank(low.weights) == 8
    # more outputs than inputs (a predictor per neuron): the same reduced-rank fit through xc's QR factor
    wide = neurons.fit_linear(x[fit, :8], contrib[fit, :64], rank=4)
    full = neurons.fit_linear(x[fit, :8], contrib[fit, :64])
    xc = x[fit, :8] - x[fit, :8].mean(axis=0)
    vt = np.linalg.svd(xc @ full.weights.astype(np.float64), full_matrices=False)[2][:4]
    np.testing.assert_allclose(wide.weights, full.weights @ vt.T @ vt, rtol=1e-3, atol=1e-4)
    assert neurons.recall_of(neurons.top_k(low.scores(x[held]), k), need) > 0.85
    # the recall-first threshold chosen on the fit tokens holds on the held-out ones
    tau = neurons.recall_threshold(model.scores(x[fit]), neurons.needed(mass[fit]), 0.95)
    assert neurons.recall_of(neurons.threshold(model.scores(x[held]), tau), need) > 0.93
    # scores of other tokens (the groups' sizes, nothing of x) do worse: the check can fail
    shuffled = np.random.default_rng(2).permutation(model.scores(x[held]))
    assert neurons.recall_of(neurons.top_k(shuffled, k), need) < 0.85


def test_needed_is_the_fewest_groups_holding_the_share():
    mass = np.array([[5.0, 1.0, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    np.testing.assert_array_equal(neurons.needed(mass, 0.8), [[True, False, True, False], [True, True, True, True]])
    np.testing.assert_array_equal(neurons.needed(mass, 0.5), [[True, False, False, False], [True, True, False, False]])


def test_hot_first_is_a_permutation_hottest_first():
    _, h, down, _ = planted(300)
    contrib = np.abs(h) * np.linalg.norm(down, axis=0)
    order = neurons.hot_first_order(contrib)
    np.testing.assert_array_equal(np.sort(order), np.arange(N_FF))
    means = contrib.mean(axis=0)[order]
    assert np.all(np.diff(means) <= 0)
    for layout in (neurons.hot_first(contrib, G, 64), neurons.coactivated(contrib, G, 64)):
        np.testing.assert_array_equal(layout.hot, order[:64])
        np.testing.assert_array_equal(np.sort(np.concatenate([layout.hot, layout.groups.ravel()])), np.arange(N_FF))
        assert layout.groups.shape == ((N_FF - 64) // G, G)
    with pytest.raises(Exception, match="groups of"):
        neurons.hot_first(contrib, G, 50)


def test_bytes_of_a_known_layout():
    sizes = neurons.neuron_bytes(1536)  # Qwen2.5-1.5B: Q4_K gate/up rows, Q8_0 down columns
    assert (sizes.gate, sizes.up, sizes.down) == (864, 864, 1632)
    n_ff, n_hot, size, k = 8960, 1024, 64, 10
    layout = neurons.Layout("x", hot=np.arange(n_hot), groups=np.arange(n_hot, n_ff).reshape(-1, size))
    mask = np.zeros((7, layout.n_groups), dtype=bool)
    mask[:, :k] = True
    assert neurons.bytes_share(mask, layout, sizes) == (1024 + 640) / 8960
    assert neurons.bytes_share(mask, layout, sizes, whole_gate=True) == pytest.approx(
        (8960 * 864 + 1664 * (864 + 1632)) / (8960 * 3360), rel=1e-12)


def test_study_of_a_layer_runs_its_grid():
    x, h, down, _ = planted(600)
    gate = np.random.default_rng(3).standard_normal((N_FF, N_EMBD)).astype(np.float32) / 16
    study = layerstudy.Study(groups=(1, 32, 64), hots=(0, 64), ranks=(0, 16), kept_shares=(0.5, 1.0),
                          coactivation_min=64, coactivation_hots=(64,), neuron_ranks=(16,))
    rows = study.layer(0, x, h, gate, down)
    assert {(r.layout, r.G, r.n_hot) for r in rows} == {("hot-first", 1, 0), ("hot-first", 32, 0), ("hot-first", 32, 64),
                                                        ("hot-first", 64, 0), ("hot-first", 64, 64),
                                                        ("coactivation", 64, 64)}
    assert {r.predictor for r in rows} == {"oracle", "static", "linear", "gate"}
    assert {(r.predictor, r.rank) for r in rows if r.G == 1} == {("oracle", 0), ("static", 0), ("gate", 0),
                                                                   ("linear", 16)}
    static = [r for r in rows if r.predictor == "static" and r.selection == "top-k"]
    assert all(r.k == int(r.k) for r in static)  # the same groups for every token
    for r in rows:
        assert 0 <= r.recall <= 1 and 0 <= r.rel_err <= 1.5 and 0 < r.kept_bytes_share <= 1 + 1e-9
        if r.selection == "top-k" and r.target == 1.0:  # every group read: the dense FFN
            assert r.rel_err < 1e-5 and r.mass_kept == pytest.approx(1.0) and r.recall == 1.0
            assert r.kept_bytes_share == pytest.approx(1.0)
    half = [r for r in rows if r.selection == "top-k" and r.target == 0.5 and r.predictor != "gate"]
    assert all(r.kept_bytes_share == pytest.approx(0.5, abs=0.07) for r in half)


def test_routed_rows_of_a_given_split():
    x, h, down, layout = planted()
    contrib = np.abs(h) * np.linalg.norm(down, axis=0)
    mass = neurons.group_mass(contrib, layout)
    router = neurons.fit_linear(x[:960], mass[:960]).weights.T  # (n_groups, n_embd), no intercept: as a file's
    rows = layerstudy.routed_rows(0, x, h, down, layout, router, (4, 8, 16))
    assert [r.k for r in rows] == [4, 8, 16]
    assert rows[0].rel_err > rows[1].rel_err > rows[2].rel_err and rows[2].rel_err < 1e-5
    assert rows[1].kept_bytes_share == 0.5 and rows[1].recall > 0.6
