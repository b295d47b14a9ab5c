"""How much each lower precision harms the model, measured (M2Cache's question; issue 17, item 2).

A weight matrix given a lower type changes the model's next-token distribution. Measuring that per tensor would take
a requantized file and a perplexity run each: a few hundred for a 1.5B model, hours here. So tensors are measured in
groups: one kind (attn_q, ffn_down, ...) over a run of consecutive layers, at one file type (Q4_K_M keeps some
attn_v and ffn_down at Q6_K), and the embeddings and output matrices each on their own. A group is lowered alone,
everything else left at the file's types, and two harms are measured:

- KL divergence of the token distribution against the file's own, over a calibration text (`llama-perplexity
  --kl-divergence`; the text is HumanEval's tuning problems 0-39 with their solutions, never the evaluation
  problems 40-163);
- UQEst, M2Cache's uncertainty: the mean entropy of the next-token distribution over text the model generates
  greedily from calibration prompts. A model that lost precision grows less sure of its own continuations.

The walk (plan/mixed.py) adds the groups' KL divergences as the harm of a plan; the sum is checked by
measuring the mixed model itself. Results are cached per model file, group layout, ladder and calibration, and
written as each group is measured, so an interrupted profile resumes where it stopped.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flexoffload import FlexoffloadError, native
from flexoffload.defaults import cache_dir, content_key, file_key, write_atomic
from flexoffload.gguf.model import Model
from flexoffload.measure import about, requantize
from flexoffload.native import tools
from flexoffload.plan import qtypes
from flexoffload.plan.qtypes import Row, Sensitivity
from flexoffload.prompts import humaneval

N_GROUPS = 4  # layer groups per kind: 7 layers each on the 1.5B's 28
KLD_CTX = 512  # llama-perplexity's -c: it scores the second half of each chunk
KLD_CHUNKS = 4  # chunks of the calibration text: 1024 scored tokens
UQ_PROMPTS = 2  # calibration prompts generated from for UQEst
UQ_TOKENS = 32  # tokens generated from each
TIMEOUT_S = 1800

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Group:
    """Tensors lowered together: one kind over consecutive layers, all at one file type."""
    kind: str
    first: int | None  # the layer range, None for tensors outside the blocks
    last: int | None
    type: str  # the file's type of every tensor in it
    tensors: tuple[str, ...]

    @property
    def name(self) -> str:
        layers = "" if self.first is None else f"@{self.first}-{self.last}"
        return f"{self.kind}{layers}:{self.type}"


def groups(model: Model, n_groups: int = N_GROUPS) -> list[Group]:
    """The model's re-typable tensors in groups: per kind, the layers cut into n_groups runs, each run split by the
    file's type; tensors outside the blocks one group each."""
    out = []
    bounds = [round(i * model.n_layer / n_groups) for i in range(n_groups + 1)]
    kinds = []
    for t in model.tensors:
        if qtypes.quantizable(t) and t.kind not in kinds:
            kinds.append(t.kind)
    for kind in kinds:
        ts = [t for t in model.tensors if t.kind == kind and qtypes.quantizable(t)]
        outside = [t for t in ts if t.layer is None]
        for t in outside:
            out.append(Group(kind, None, None, t.type, (t.name,)))
        for first, stop in zip(bounds, bounds[1:]):
            in_run = [t for t in ts if t.layer is not None and first <= t.layer < stop]
            for type_name in sorted({t.type for t in in_run}):
                names = tuple(t.name for t in in_run if t.type == type_name)
                out.append(Group(kind, first, stop - 1, type_name, names))
    return out


def group_candidates(model: Model, group: Group, ladder: tuple[str, ...] = qtypes.LADDER) -> list[str]:
    """The lower types every tensor of the group can take; of types with the same bits per weight, the ladder's
    first (a K-quant over the legacy type of its size)."""
    by_name = {t.name: t for t in model.tensors}
    common = None
    for name in group.tensors:
        c = qtypes.candidates(by_name[name], ladder)
        common = c if common is None else [x for x in common if x in c]
    out, sizes = [], set()
    for name in sorted(common or [], key=lambda n: ladder.index(n) if n in ladder else len(ladder)):
        bpw = qtypes.qtype(name).bits_per_weight
        if bpw not in sizes:
            sizes.add(bpw)
            out.append(name)
    return sorted(out, key=lambda n: -qtypes.qtype(n).bits_per_weight)


def calibration_text() -> str:
    return humaneval.solved(humaneval.TUNING)


def held_out_text() -> str:
    """Text for reporting perplexity and KL divergence of a plan, never used to choose it."""
    return humaneval.solved(humaneval.EVALUATION)


def calibration_prompts(count: int = UQ_PROMPTS) -> list[str]:
    return [p for _, p in humaneval.prompts(humaneval.tuning_ids(count))]


# --- KL divergence (llama-perplexity) ---------------------------------------------------------------------------

def kld_base(model: Model, text: str, n_ctx: int = KLD_CTX, n_chunks: int = KLD_CHUNKS,
             n_threads: int | None = None) -> Path:
    """The file's own log-probabilities over the text (llama-perplexity --kl-divergence-base), cached."""
    key = content_key(text, str(n_ctx), str(n_chunks))
    out = cache_dir() / "precision" / f"{file_key(model.path)}-logits-{key}.bin"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / "logits.bin"
        _perplexity(model.path, text, n_ctx, n_chunks, n_threads, ["--kl-divergence-base", str(partial)])
        os.replace(partial, out)
    return out


def kld(path: Path, base: Path, text: str, n_ctx: int = KLD_CTX, n_chunks: int = KLD_CHUNKS,
        n_threads: int | None = None, extra: list[str] = ()) -> dict:
    """The model at path against the base log-probabilities: mean KL divergence (and its error), perplexity, and
    how often the top token is the same. extra: more llama-perplexity arguments (an --override-kv)."""
    out = _perplexity(path, text, n_ctx, n_chunks, n_threads,
                      ["--kl-divergence-base", str(base), "--kl-divergence", *extra])
    return parse_kld(out)


def parse_kld(log: str) -> dict:
    """llama-perplexity's KL divergence summary: {kld, kld_err, ppl, ppl_base, same_top}."""
    def value(label: str) -> tuple[float, float]:
        m = re.search(re.escape(label) + r"\s*:\s*([-\d.naif]+)(?:\s*±\s*([-\d.naif]+))?", log)
        if not m:
            raise FlexoffloadError(f"llama-perplexity printed no '{label}'")
        return float(m.group(1)), float(m.group(2) or "nan")

    mean, err = value("Mean    KLD")
    same, _ = value("Same top p")
    return {"kld": mean, "kld_err": err, "ppl": value("Mean PPL(Q)")[0], "ppl_base": value("Mean PPL(base)")[0],
            "same_top": same / 100}


def _perplexity(path: Path, text: str, n_ctx: int, n_chunks: int, n_threads: int | None, extra: list[str]) -> str:
    """llama-perplexity's output (stdout and stderr) for the model at path over the text, extra its arguments."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        args = ["-m", str(path), "-f", f.name, "-c", str(n_ctx), "-b", str(n_ctx), "--chunks", str(n_chunks)] + extra
        r = tools.run("llama-perplexity", args, TIMEOUT_S, n_threads=n_threads or os.cpu_count() or 1)
    return r.stdout + r.stderr


# --- UQEst (M2Cache's uncertainty over generated text) ----------------------------------------------------------

def entropy(logits) -> float:
    """The entropy (nats) of the softmax of a logits vector."""
    import numpy as np

    z = logits.astype(np.float64) - float(logits.max())
    p = np.exp(z)
    s = p.sum()
    return float(math.log(s) - (p * z).sum() / s)


def uqest(path: Path, prompts: list[str], n_predict: int = UQ_TOKENS, n_threads: int | None = None) -> dict:
    """M2Cache's UQEst: the mean entropy of the model's next-token distribution over the tokens it generates
    greedily from each prompt (prompt tokens excluded); and the generated tokens, to compare models by."""
    from flexoffload.runtime import engine

    settings = engine.Settings(n_ctx=1024, n_batch=512, n_threads=n_threads or os.cpu_count() or 1, temp=0.0,
                               strategy="mmap")
    total, count, generated = 0.0, 0, []
    with engine.Engine(str(path), settings) as e:
        for prompt in prompts:
            tokens = e.start(prompt)
            for i in range(0, len(tokens), e.n_batch):
                e._decode(tokens[i:i + e.n_batch])
            out = []
            for _ in range(n_predict):
                logits = e.last_logits()
                total += entropy(logits)
                count += 1
                token = int(logits.argmax())
                out.append(token)
                if e.lib.llama_vocab_is_eog(e.vocab, token) or len(tokens) + len(out) >= settings.n_ctx:
                    break
                e._decode([token])
            generated.append(out)
    return {"uqest": total / max(count, 1), "tokens": generated}


# --- the profile --------------------------------------------------------------------------------------------------

def cache_path(model: Model, n_groups: int, ladder: tuple[str, ...]) -> Path:
    key = content_key(str(n_groups), ",".join(ladder), str(KLD_CTX), str(KLD_CHUNKS), str(UQ_PROMPTS),
                         str(UQ_TOKENS), native.key())
    return cache_dir() / "precision" / f"{file_key(model.path)}-sensitivity-{key}.json"


def load_cached(model: Model, n_groups: int = N_GROUPS,
                ladder: tuple[str, ...] = qtypes.LADDER) -> Sensitivity | None:
    p = cache_path(model, n_groups, ladder)
    if not p.is_file():
        return None
    d = json.loads(p.read_text())
    return Sensitivity(**{**d, "rows": [Row(**r) for r in d["rows"]]})


def _save(path: Path, s: Sensitivity) -> None:
    write_atomic(path, json.dumps(asdict(s), indent=1))


def _same_share(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of b's tokens equal to a's, position by position, up to the first difference in each sequence."""
    same = total = 0
    for x, y in zip(a, b):
        total += len(x)
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same / max(total, 1)


# One measurement (a group requantized, its KL divergence and UQEst) took about 35 s on the 1.5B's 1.06 GB file
# here (issue 17's profile: 94 in 55 min): the estimate before a profile scales it by the file's size.
SECONDS_PER_GB = 33.0
SECONDS_FIXED = 0.15  # and a small model's: the tools' start (measured: 32 in 5 s for a 1 MB model)


def measure(model: Model, n_groups: int = N_GROUPS, ladder: tuple[str, ...] = qtypes.LADDER,
            n_threads: int | None = None, remeasure: bool = False, on_row=None) -> Sensitivity:
    """Each group at each of its lower types, alone: its KL divergence and UQEst. Cached; resumes a partial run."""
    path = cache_path(model, n_groups, ladder)
    cached = None if remeasure else load_cached(model, n_groups, ladder)
    text = calibration_text()
    prompts = calibration_prompts()
    matrix = requantize.imatrix(model, text, n_threads=n_threads)
    base = kld_base(model, text, n_threads=n_threads)
    if cached is None:
        own = uqest(model.path, prompts, n_threads=n_threads)
        own_ppl = kld(model.path, base, text, n_threads=n_threads)["ppl"]
        cached = Sensitivity(model.path.name, n_groups, list(ladder), own["uqest"], own_ppl, [])
        cached_tokens = own["tokens"]
    else:
        cached_tokens = None
    path.parent.mkdir(parents=True, exist_ok=True)
    _save(path, cached)
    by_name = {t.name: t for t in model.tensors}
    work = [(g, ty) for g in groups(model, n_groups) for ty in group_candidates(model, g, ladder)]
    left = sum(cached.row(g.name, ty) is None for g, ty in work)
    if left:
        log.info("measuring how %s takes lower precision: %d groups of tensors at each lower type, %d measurements "
                 "of %d left, %s here (cached as they go: an interrupted run resumes; `flexoffload profile "
                 "--precision -m %s` does it ahead)", model.path.name, n_groups, left, len(work),
                 about(left * (SECONDS_FIXED + SECONDS_PER_GB * model.file_size / 1e9)), model.path)
    started, done = time.monotonic(), 0
    for g, ty in work:
        if cached.row(g.name, ty) is not None:
            continue
        if cached_tokens is None:
            cached_tokens = uqest(model.path, prompts, n_threads=n_threads)["tokens"]
        types = {name: ty for name in g.tensors}
        mixed = requantize.requantize(model, types, matrix, n_threads=n_threads)
        try:
            q = kld(mixed, base, text, n_threads=n_threads)
            u = uqest(mixed, prompts, n_threads=n_threads)
        finally:
            mixed.unlink(missing_ok=True)  # one group's file is not kept: a plan writes its own
        saved = sum(by_name[n].n_bytes - qtypes.tensor_bytes(by_name[n], ty) for n in g.tensors)
        row = Row(g.name, g.kind, g.first, g.last, g.type, ty, list(g.tensors), saved, q["kld"], q["kld_err"],
                  q["ppl"], q["same_top"], u["uqest"], u["uqest"] - cached.base_uqest,
                  _same_share(cached_tokens, u["tokens"]))
        cached.rows.append(row)
        _save(path, cached)
        done += 1
        if on_row:  # the caller shows the progress (a bar)
            on_row(row, len(cached.rows), len(work))
        else:
            log.info("precision %d/%d: %s at %s, KL divergence %.4f; %s left", len(cached.rows), len(work), g.name,
                     ty, q["kld"], about((time.monotonic() - started) / done * (left - done)))
    return cached


def quality(model: Model, path: Path, n_threads: int | None = None) -> dict:
    """A re-typed file of the model against the model itself: KL divergence on the calibration text (what the plan's
    bound is in) and on the held-out text (HumanEval 40-163, never used to choose), the held-out perplexity of both,
    and UQEst on the calibration prompts against the model's own. Cached per file (two plans may pick one)."""
    cached = cache_dir() / "precision" / f"{file_key(path)}-quality-{native.key()}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    calibration, held_out = calibration_text(), held_out_text()
    on_calibration = kld(path, kld_base(model, calibration, n_threads=n_threads), calibration, n_threads=n_threads)
    on_held_out = kld(path, kld_base(model, held_out, n_threads=n_threads), held_out, n_threads=n_threads)
    prompts = calibration_prompts()
    own, mixed = uqest(model.path, prompts, n_threads=n_threads), uqest(path, prompts, n_threads=n_threads)
    out = {"kld": on_calibration["kld"], "kld_err": on_calibration["kld_err"],
           "held_out_kld": on_held_out["kld"], "held_out_kld_err": on_held_out["kld_err"],
           "held_out_ppl": on_held_out["ppl"], "held_out_ppl_base": on_held_out["ppl_base"],
           "same_top": on_held_out["same_top"], "uqest": mixed["uqest"], "uqest_base": own["uqest"],
           "same_tokens": _same_share(own["tokens"], mixed["tokens"])}
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(out))
    return out
