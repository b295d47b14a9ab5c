"""A draft model's output head cut to the tokens it is likeliest to draft, as FR-Spec does (arXiv 2502.14856).

The head of a small draft is a large share of it: the 0.5B Qwen's 151,936 rows are 145 MB of its 491, read at every
draft step and resident beside the target, whose streamed bytes it adds to on every pass. Cut to the 32,768 tokens
a corpus uses most, it is 31 MB, and the draft still drafts in the target's token ids: the copy keeps the whole
vocabulary and the token embeddings, and names the token of each kept row in `output_ids.weight` (I32). Patch 0032
loads such a head and puts its logits back at those ids, every other token at -inf, so a token outside the head is
never drafted and the target's verification keeps the output lossless.

A prompt's own words are often not among a corpus's most used (HumanEval/81's `_grade`, ` grades`), and a draft that
cannot propose them breaks its chain at each. So the head's last rows are spare: the copy names its source, and a
run points the spare rows at the prompt's tokens the head lacks, their rows read from the source
(speculation/head.py, patch 0032's llama_head_set_rows).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from flexoffload import FlexoffloadError
from flexoffload.gguf.model import metadata

HEAD = "output.weight"
IDS = "output_ids.weight"
EMBEDDINGS = "token_embd.weight"  # a model with tied embeddings has no head of its own: its rows are these
SOURCE = "flexoffload.head.source"  # the file the head was cut from: the rows of the tokens it lacks are there
SPARE = "flexoffload.head.spare"  # the last rows, the least used of those kept: a run may point them at others


def source(path: str | os.PathLike) -> tuple[Path, int] | None:
    """The file a cut head was cut from and its spare rows (SPARE), or None for a whole head."""
    kv = metadata(path)
    return (Path(kv[SOURCE]), int(kv.get(SPARE, 0))) if SOURCE in kv else None


def head_tensor(model):
    """The model's head: output.weight, or the token embeddings a tied model multiplies by."""
    return next((t for t in model.tensors if t.name == HEAD), None) or \
        next((t for t in model.tensors if t.name == EMBEDDINGS), None)


def rows(model) -> int | None:
    """The rows of a loaded model's cut head, or None where its head is whole."""
    ids = next((t for t in model.tensors if t.name == IDS), None)
    return int(ids.shape[0]) if ids is not None else None


def write(src: str | os.PathLike, dst: str | os.PathLike, ids, spare: int = 0) -> Path:
    """Write a copy of the GGUF at src to dst (atomically: a part file renamed) whose output head keeps the rows of
    ids alone (distinct token ids, in their order), with output_ids.weight naming them, the last `spare` of them
    spare (SPARE) and src named as the source (SOURCE). Every other tensor and key is copied as stored; a model
    with tied embeddings gets a head of its own, cut from its embeddings."""
    import gguf

    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(src)
    tensors = {t.name: t for t in reader.tensors}
    if IDS in tensors:
        raise FlexoffloadError(f"{src.name}'s output head is already cut")
    head = tensors.get(HEAD, tensors.get(EMBEDDINGS))
    if head is None:
        raise FlexoffloadError(f"{src.name} has neither an output head nor token embeddings to cut one from")
    n_vocab = int(head.shape[-1])  # gguf's shape lists ne: (n_embd, n_vocab)
    ids = np.asarray(ids, dtype=np.int64).ravel()
    if not 0 < ids.size < n_vocab or ids.min() < 0 or ids.max() >= n_vocab or np.unique(ids).size != ids.size:
        raise FlexoffloadError(f"a cut head keeps between 1 and {n_vocab - 1} distinct token ids of {n_vocab}")
    if not 0 <= spare <= ids.size:
        raise FlexoffloadError(f"a cut head of {ids.size} rows cannot have {spare} spare")

    cut = np.ascontiguousarray(head.data[ids])  # a row's bytes are its blocks, whatever the type
    plan = [(t.name, t.data, t.tensor_type) for t in reader.tensors if t.name != HEAD] + \
        [(HEAD, cut, head.tensor_type), (IDS, ids.astype(np.int32), gguf.GGMLQuantizationType.I32)]
    tmp = dst.with_name(dst.name + ".part")
    try:
        w = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
        w.add_string(SOURCE, str(src.resolve()))
        w.add_uint32(SPARE, spare)
        for name, data, qtype in plan:
            w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for _, data, _ in plan:
            w.write_tensor_data(data)
        w.close()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)  # nothing half-written is left in the cache
        raise
    return dst
