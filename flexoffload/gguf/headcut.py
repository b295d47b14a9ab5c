"""A draft model's output head cut to the tokens it is likeliest to draft, as FR-Spec does (arXiv 2502.14856).

The head of a small draft is a large share of it: the 0.5B Qwen's 151,936 rows are 145 MB of its 491, read at every
draft step and resident beside the target, whose streamed bytes it adds to on every pass. Cut to the 32,768 tokens
a corpus uses most, it is 31 MB, and the draft still drafts in the target's token ids: the copy keeps the whole
vocabulary and the token embeddings, and names the token of each kept row in `output_ids.weight` (I32). Patch 0032
loads such a head and puts its logits back at those ids, every other token at -inf, so a token outside the head is
never drafted and the target's verification keeps the output lossless.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from flexoffload import FlexoffloadError

HEAD = "output.weight"
IDS = "output_ids.weight"
EMBEDDINGS = "token_embd.weight"  # a model with tied embeddings has no head of its own: its rows are these


def rows(path: str | os.PathLike) -> int | None:
    """The rows of the file's cut head, or None where its head is whole."""
    import gguf

    ids = next((t for t in gguf.GGUFReader(path).tensors if t.name == IDS), None)
    return int(ids.n_elements) if ids is not None else None


def write(src: str | os.PathLike, dst: str | os.PathLike, ids) -> Path:
    """Write a copy of the GGUF at src to dst (atomically: a part file renamed) whose output head keeps the rows of
    ids alone (distinct token ids, kept in ascending order), with output_ids.weight naming them. Every other tensor
    and key is copied as stored; a model with tied embeddings gets a head of its own, cut from its embeddings."""
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
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    if ids.size == 0 or ids[0] < 0 or ids[-1] >= n_vocab or ids.size >= n_vocab:
        raise FlexoffloadError(f"a cut head keeps between 1 and {n_vocab - 1} distinct token ids of {n_vocab}")

    tmp = dst.with_name(dst.name + ".part")
    w = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)

    cut = np.ascontiguousarray(head.data[ids])  # a row's bytes are its blocks, whatever the type
    plan = [(t.name, t.data) for t in reader.tensors if t.name != HEAD] + [(HEAD, cut), (IDS, ids.astype(np.int32))]
    for name, data in plan:
        t = tensors.get(name, head)
        if name == IDS:
            w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=gguf.GGMLQuantizationType.I32)
        else:
            w.add_tensor_info(name, data.shape, data.dtype, data.nbytes, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, data in plan:
        w.write_tensor_data(data)
    w.close()
    os.replace(tmp, dst)
    return dst
