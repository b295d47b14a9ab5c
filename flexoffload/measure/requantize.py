"""The requantized GGUF a choice of lower types makes, and the importance matrix it is weighed by (M2Cache, issue 17).

plan/qtypes.py says which types a tensor can take; this module writes the files, with llama.cpp's own tools
(native/tools.py), content-addressed in the cache: the mixed file with `llama-quantize` (`requantize`), the
importance matrix with `llama-imatrix` (`imatrix`).

Requantizing an already quantized file loses more than quantizing from the original weights: the first rounding's
error stays and a second one is added on top. The models here ship quantized (Q4_K_M, the original F16 weights are
not reachable), so they are requantized; where the original F16/BF16 file is at hand, pass it as `original`
(`plan --precision auto --original FILE`) and every tensor is quantized from it instead: the plan's tensors to their
types, the rest to the file's own.

An importance matrix (`llama-imatrix` on a calibration text) weighs the rounding by how much each input column
matters; the lowest types (IQ2_XXS, IQ2_XS, IQ1_*) refuse to quantize without one.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from flexoffload import FlexoffloadError, native
from flexoffload.defaults import cache_dir, content_key, file_key
from flexoffload.gguf.model import Model, load
from flexoffload.native import tools
from flexoffload.plan.qtypes import UNQUANTIZED, quantizable, validate

QUANTIZE_TIMEOUT_S = 1800


def imatrix(model: Model, text: str, n_ctx: int = 512, n_chunks: int = 0, n_threads: int | None = None,
            timeout: float = 3600) -> Path:
    """The importance matrix of the model on a calibration text (llama-imatrix), cached by file and text."""
    key = content_key(text, str(n_ctx), str(n_chunks))
    out = cache_dir() / "precision" / f"{file_key(model.path)}-imatrix-{key}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        text_file, partial = Path(tmp) / "calibration.txt", Path(tmp) / "imatrix.gguf"
        text_file.write_text(text, encoding="utf-8")
        args = ["-m", str(model.path), "-f", str(text_file), "-o", str(partial), "-c", str(n_ctx), "--no-ppl",
                "--output-frequency", "100000"]
        if n_chunks:
            args += ["--chunks", str(n_chunks)]
        tools.run("llama-imatrix", args, timeout, n_threads=n_threads or os.cpu_count() or 1)
        if not partial.is_file():
            raise FlexoffloadError("llama-imatrix wrote no importance matrix")
        os.replace(partial, out)
    return out


def mixed_path(model: Model, types: dict[str, str], imatrix_path: Path | None, original: Path | None = None) -> Path:
    """Where the requantized file of a plan's types lives in the cache: named by its inputs."""
    plan = json.dumps(sorted(types.items()))
    src = file_key(original) if original else ""
    im = file_key(imatrix_path) if imatrix_path else ""
    key = content_key(file_key(model.path), src, im, plan, native.key())
    return cache_dir() / "mixed" / f"{model.path.stem}-{key}.gguf"


def _pattern(name: str) -> str:
    """An exact-name pattern for llama-quantize's --tensor-type (a std::regex it searches with)."""
    return "^" + re.escape(name) + "$"


def check_original(model: Model, original: Path) -> Path:
    """The original (unquantized) weights of the model: every weight matrix of the file, by name and shape, at
    F32/F16/BF16. Otherwise a one-line error naming the first tensor that differs."""
    by_name = {t.name: t for t in load(original).tensors}
    for t in model.tensors:
        if not quantizable(t):
            continue
        o = by_name.get(t.name)
        if o is None:
            raise FlexoffloadError(f"{original.name} is not the original of {model.path.name}: it has no {t.name}")
        if o.shape != t.shape:
            raise FlexoffloadError(f"{original.name} is not the original of {model.path.name}: {t.name} is "
                                   f"{'x'.join(map(str, o.shape))}, not {'x'.join(map(str, t.shape))}")
        if o.type not in UNQUANTIZED:
            raise FlexoffloadError(f"{original.name} is quantized ({t.name} is {o.type}): the original weights are "
                                   f"{', '.join(UNQUANTIZED)}")
    return original


def requantize(model: Model, types: dict[str, str], imatrix_path: Path | None = None, original: Path | None = None,
               n_threads: int | None = None, timeout: float = QUANTIZE_TIMEOUT_S) -> Path:
    """The GGUF with the plan's types (every other tensor at the file's own type, copied byte for byte), written by
    llama-quantize into the cache under a name of its inputs; an existing one is reused. Written to a temporary
    file first, so a failure never leaves a damaged model behind.

    original: the original (F16/BF16) file of the same model, to quantize from instead of requantizing."""
    types = validate(model, types, imatrix_path)
    if original is not None:
        check_original(model, original)
    out = mixed_path(model, types, imatrix_path, original)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # every weight matrix named, so none takes the target ftype's own choice: the plan's type or the file's
    lines = [f"{_pattern(t.name)}={types.get(t.name, t.type)}" for t in model.tensors if quantizable(t)]
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        type_file, partial = Path(tmp) / "types.txt", Path(tmp) / "mixed.gguf"
        type_file.write_text("\n".join(lines) + "\n")
        args = ["--allow-requantize", "--tensor-type-file", str(type_file)]
        if imatrix_path:
            args += ["--imatrix", str(imatrix_path)]
        # llama-quantize takes its threads as its last positional argument, not -t
        args += [str(original or model.path), str(partial), "Q4_K_M", str(n_threads or os.cpu_count() or 1)]
        tools.run("llama-quantize", args, timeout)
        os.replace(partial, out)
    return out
