"""Predicted neurons (M2Cache's dynamic sparsity; issue 31), built as a mixture of experts over a dense model.

A dense SwiGLU FFN's neurons are grouped (measure/coactivation.py, MoEfication): a hot set every token reads (the
neurons of the largest mean contribution: M2Cache's and PowerInfer's hot neurons) and groups of neurons that fire
together, with a linear predictor of each group's share of the FFN's output from the FFN's input (Deja Vu's
predictor, one least-squares layer). gguf/moefy.py writes that as a glm4moe file: the hot set is the shared
expert, a group an expert (gate rows, up rows and down columns each one contiguous slice: the bundling of LLM in a
Flash, whose transposed down matrix is requantized to Q8_0), the predictor the router. A token then reads its k
predicted groups the way an expert is read (docs/moe.md: the routed slices, a per-layer cache of them, or the
tensors whole when that is faster), and k is the sparsity: the file's expert_used_count, one copy per k
(moefy.with_used).

build() makes the grouped file (every step cached); measure() adds, per k, the KL divergence against the dense file
on held-out text, the share of the model a token reads, and the predictor's mass and recall on held-out
calibration tokens: `flexoffload profile --neurons`. Measured on Qwen2.5-Coder-1.5B: docs/neurons.md.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, content_key, file_key, write_atomic
from flexoffload.gguf import moefy
from flexoffload.gguf.model import Model, load
from flexoffload.measure import sensitivity
from flexoffload.plan.levels import Level, Sparsity

N_CTX = 512  # the capture's context (chunks of the calibration text)
CAPTURE_VERSION = "1"  # bump when the capture changes
SPLIT_VERSION = "2"  # bump when the split or its quality changes (2: the router's recall)
GROUPS = 32  # groups a layer: 32 is the most a token's k can reach (llama.cpp's graph holds 8 nodes a tensor)
HOT_SHARE = 0.08  # at least this share of the neurons is hot (the 1.5B: 768 of 8960, a fifth of a token's mass)
BLOCK = 32  # a group's neurons are whole Q8_0 blocks of ffn_down's rows
DOWN_TYPE = "Q8_0"
USED = (16, 20, 24, 28, 30, 32)  # the k measured by default, of 32: all 32 is the dense FFN (the re-layout's cost)
KLD_CHUNKS = 16  # held-out chunks of N_CTX tokens (llama-perplexity scores each one's second half)
KLD_VERSION = "1"


# what check refuses, written once: rules.py's "sparsity-dense" says it of --sparsity before anything loads (the file
# named, and its architecture: "qwen3moe with experts")
DENSE_ONLY = "{name} is {kind}: predicted neurons are built for a dense " + moefy.SOURCE_ARCH + " model"


def check(model: Model) -> None:
    """Only a dense qwen2 with a SwiGLU FFN is grouped (moefy's source architecture): build's guard (profile
    --neurons, the API)."""
    if model.arch != moefy.SOURCE_ARCH or model.n_expert:
        kind = model.arch + (" with experts" if model.n_expert else "")
        raise FlexoffloadError(DENSE_ONLY.format(name=model.path.name, kind=kind))


def _say(say, msg: str) -> None:
    if say:
        say(msg)


def layout(n_ff: int, n_group: int = GROUPS) -> tuple[int, int]:
    """(neurons a group, hot neurons) for n_group groups: the widest group, whole blocks, that leaves at least
    HOT_SHARE hot; glm4moe sizes the shared expert in groups, so the group's width divides n_ff."""
    for width in range(n_ff // (n_group + 1) // BLOCK * BLOCK, 0, -BLOCK):
        hot = n_ff - n_group * width
        if n_ff % width == 0 and hot >= HOT_SHARE * n_ff:
            return width, hot
    raise FlexoffloadError(f"{n_ff} neurons do not make {n_group} groups of whole blocks of {BLOCK} and a hot set")


def capture(model: Model, say=None, n_threads: int | None = None) -> Path:
    """The calibration capture (each layer's FFN input and activation, coactivation.collect), one .npy pair a layer,
    cached."""
    import numpy as np

    from flexoffload.measure import coactivation

    text = sensitivity.calibration_text()
    # beside the MoE test bed's (scripts/moe_testbed), which is this same file at another k
    key = content_key(file_key(model.path), text, str(N_CTX), CAPTURE_VERSION)
    folder = cache_dir() / "moe_testbed" / f"capture-{key}"
    if (folder / "done").is_file():
        return folder
    _say(say, f"capturing the FFN inputs and activations of {model.path.name} over the calibration text "
              f"({len(text)} characters; minutes)")
    got = coactivation.collect(str(model.path), text, n_ctx=N_CTX, n_threads=n_threads)
    folder.mkdir(parents=True, exist_ok=True)
    for il in range(model.n_layer):
        np.save(folder / f"x{il}.npy", got.inputs[il])
        np.save(folder / f"h{il}.npy", got.activations[il])
    (folder / "done").write_text(str(got.n_tokens))
    return folder


def split(model: Model, folder: Path, n_group: int, n_hot: int, say=None):
    """Each layer's split (coactivation.split; cached .npz) and its quality on held-out calibration tokens for each
    k from 1 to n_group: (splits, per layer a list of SplitQuality)."""
    import numpy as np

    from flexoffload.measure import coactivation

    key = content_key(folder.name, str(n_group), str(n_hot), SPLIT_VERSION)
    splits, quality, norms = [], [], None
    for il in range(model.n_layer):
        f = folder.parent / f"split-{key}-{il}.npz"
        if not f.is_file():
            if norms is None:
                norms = coactivation.down_norms(str(model.path), model.n_layer)
            t0 = time.time()
            layer, q = coactivation.split(np.load(folder / f"x{il}.npy"), np.load(folder / f"h{il}.npy"), norms[il],
                                          n_group, n_hot, used=tuple(range(1, n_group + 1)))
            np.savez(f.with_suffix(".part.npz"), shared=layer.shared, experts=layer.experts, router=layer.router,
                     quality=np.array([[x.n_expert_used, x.routed, x.oracle, x.random, x.recall] for x in q]))
            os.replace(f.with_suffix(".part.npz"), f)
            _say(say, f"layer {il}: grouped in {time.time() - t0:.0f} s")
        z = np.load(f)
        splits.append(moefy.LayerSplit(shared=z["shared"], experts=z["experts"], router=z["router"]))
        quality.append([coactivation.SplitQuality(int(k), *map(float, rest)) for k, *rest in z["quality"]])
    return splits, quality


def build(model: Model, n_group: int = GROUPS, n_hot: int | None = None, say=None, n_threads: int | None = None):
    """The grouped file of a dense model (every group used; cached): (its path, per layer the split's quality).
    n_hot None: as layout() says."""
    check(model)
    n_ff = model.n_ff
    n_hot = layout(n_ff, n_group)[1] if n_hot is None else n_hot
    if n_group < 1 or not 0 < n_hot < n_ff or (n_ff - n_hot) % n_group:
        raise FlexoffloadError(f"{n_ff} neurons less {n_hot} hot ones do not make {n_group} equal groups")
    folder = capture(model, say, n_threads)
    splits, quality = split(model, folder, n_group, n_hot, say)
    key = content_key(file_key(model.path), folder.name, str(n_group), str(n_hot), DOWN_TYPE, SPLIT_VERSION,
                      str(moefy.ROUTER_SCALE))
    out = cache_dir() / "sparse" / f"{model.path.stem}-{key}.gguf"
    if not out.is_file():
        _say(say, f"writing {out.name}: {n_group} groups of {(n_ff - n_hot) // n_group} neurons and {n_hot} hot ones "
                  f"a layer")
        out.parent.mkdir(parents=True, exist_ok=True)
        moefy.write(model.path, out, splits, n_group, down_type=DOWN_TYPE,
                    name=f"{model.path.stem} in groups of neurons")
    return out, quality


def kld(grouped: Path, dense: Model, n_used: int, n_threads: int | None = None) -> dict:
    """The grouped file reading n_used groups a token against the dense file on held-out text (llama-perplexity,
    the level set at load), cached: {kld, kld_err, ppl, ppl_base, same_top}."""
    text = sensitivity.held_out_text()
    path = cache_dir() / "sparse" / f"{file_key(grouped)}-kld.json"
    key = content_key(text, str(N_CTX), str(KLD_CHUNKS), KLD_VERSION, str(n_used))
    done = json.loads(path.read_text()) if path.is_file() else {}
    if key not in done:
        base = sensitivity.kld_base(dense, text, n_ctx=N_CTX, n_chunks=KLD_CHUNKS, n_threads=n_threads)
        done[key] = sensitivity.kld(grouped, base, text, N_CTX, KLD_CHUNKS, n_threads,
                                    moefy.override_used(n_used))
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(done))
    return done[key]


def default_used(n_group: int) -> tuple[int, ...]:
    """The levels measured by default: USED's shares of n_group groups."""
    return tuple(sorted({max(1, round(k * n_group / GROUPS)) for k in USED}))


def measure(model: Model, used: tuple[int, ...] | None = None, n_group: int = GROUPS, n_hot: int | None = None,
            say=None, n_threads: int | None = None, on_level=None) -> Sparsity:
    """profile --neurons: the grouped file and each level's quality (the KL divergence takes a few minutes a level
    on the 1.5B; each is cached). on_level(Level) as each is measured."""
    n_hot = layout(model.n_ff, n_group)[1] if n_hot is None else n_hot
    used = default_used(n_group) if used is None else used
    if any(not 0 < k <= n_group for k in used):  # before the build's minutes
        raise FlexoffloadError(f"groups read a token must be between 1 and {n_group}")
    grouped, quality = build(model, n_group, n_hot, say, n_threads)
    g = load(grouped)
    width = (model.n_ff - n_hot) // n_group
    levels = []
    for k in sorted(set(used)):
        _say(say, f"{k} of {n_group} groups a token: KL divergence against {model.path.name} (held-out text)")
        m = kld(grouped, model, k, n_threads)
        rows = [next(q for q in layer if q.n_expert_used == k) for layer in quality]
        mean = lambda attr: sum(getattr(q, attr) for q in rows) / len(rows)  # noqa: E731
        level = Level(n_used=k, ffn_share=(n_hot + k * width) / model.n_ff,
                      read_share=replace(g, n_expert_used=k).routed_bytes / model.weight_bytes,
                      kld=m["kld"], kld_err=m["kld_err"], ppl=m["ppl"], ppl_dense=m["ppl_base"],
                      same_top=m["same_top"], mass=mean("routed"), best_mass=mean("oracle"), recall=mean("recall"))
        levels.append(level)
        if on_level:
            on_level(level)
    s = Sparsity(model=str(model.path), file=str(grouped), n_group=n_group, group_width=width, n_hot=n_hot,
                 levels=levels)
    write_atomic(profile_path(model), json.dumps(s.to_dict()))
    return s


def profile_path(model: Model) -> Path:
    return cache_dir() / "sparse" / f"{file_key(model.path)}-profile.json"


def load_cached(model: Model) -> Sparsity | None:
    """The last `profile --neurons` of this file, if any."""
    path = profile_path(model)
    return Sparsity.from_dict(json.loads(path.read_text())) if path.is_file() else None
