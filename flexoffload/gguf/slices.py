"""A model's first layers as a GGUF of their own (a slice): every tensor outside the repeating blocks (embeddings,
output, norms), the blocks below a depth, and the metadata with the block count cut to it.

Why: a model larger than this machine's memory cannot be timed with every weight in memory, which its compute bound
needs. Two slices that fit, timed in memory, give a layer's seconds (the slope between them) and the rest (the
embeddings and the output head, once); the whole model's token is that rest plus every layer's
(measure/profiler.compute_speed). A block's tensors are the same whatever the depth, so a slice computes what
those layers of the whole model do.
"""

from __future__ import annotations

import re
from pathlib import Path

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def depths(model, room: int) -> tuple[int, int]:
    """Two depths whose slices fit in room bytes, the deeper about twice the other (the slope between them is a
    layer's seconds): as deep as fits, for a slope over many layers. ValueError where not even two layers fit."""
    layers = [0] * model.n_layer
    for t in model.tensors:
        if t.layer is not None:
            layers[t.layer] += t.n_bytes
    rest = sum(t.n_bytes for t in model.tensors if t.layer is None)
    deep = 0
    while deep < model.n_layer and rest + sum(layers[:deep + 1]) <= room:
        deep += 1
    if deep < 2:
        raise ValueError(f"not even two of its layers fit beside the rest ({rest / 1e9:.1f} GB) in {room / 1e9:.1f} GB")
    return max(1, deep // 2), deep


def write(src: str | Path, dst: str | Path, n_layer: int) -> Path:
    """Write src's first n_layer blocks to dst (ValueError where the model has fewer). Per-layer arrays in the
    metadata (a head count a layer, say) are cut to the depth; everything else is copied as it is."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(bytes(reader.fields[gguf.Keys.General.ARCHITECTURE].parts[-1]), "utf-8")
    count_key = gguf.Keys.LLM.BLOCK_COUNT.format(arch=arch)
    total = int(reader.fields[count_key].parts[-1][0])
    if not 1 <= n_layer <= total:
        raise ValueError(f"a slice of {n_layer} layers: the model has {total}")
    dst = Path(dst)
    writer = gguf.GGUFWriter(str(dst), arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == count_key:
            value = n_layer
        elif (kind == gguf.GGUFValueType.ARRAY and field.name.startswith(f"{arch}.") and isinstance(value, list)
              and len(value) == total):
            value = value[:n_layer]  # one entry a layer
        writer.add_key_value(field.name, value, kind, sub_type=sub)
    kept = [t for t in reader.tensors if not (m := _BLOCK.match(t.name)) or int(m.group(1)) < n_layer]
    for t in kept:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in kept:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return dst
