"""A mixture of experts that cannot run as given is refused in one line before anything loads (issue 53's bad
input): a router or an expert tensor of another shape than the header says, a layer's experts without a router, a
budget below the dense part plus the experts a layer's batch holds, and a file cut in the middle of an expert."""

import gguf
import numpy as np
import pytest

from conftest import cli
from flexoffload import FlexoffloadError
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from test_cli import assert_one_line_error

SHAPES = ["qwen3moe-tiny", "gpt-oss-tiny"]


def rewrite(src, dst, change):
    """src's GGUF written again to dst, each tensor through change(name, data) (None: left out)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        array = f.types[0] == gguf.GGUFValueType.ARRAY
        w.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if array else None)
    for t in r.tensors:
        data = change(t.name, np.array(t.data))
        if data is not None:
            raw = None if t.tensor_type == gguf.GGMLQuantizationType.F32 else t.tensor_type
            w.add_tensor(t.name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(params=SHAPES)
def moe(request, tmp_path):
    return synth.write(tmp_path / "moe.gguf", synth.SHAPES[request.param], seed=1)


def test_the_rewrite_alone_changes_nothing(moe, tmp_path):
    """The helper's copy loads and keeps every tensor: what the refusals below see is the change alone."""
    same = load(rewrite(moe, tmp_path / "same.gguf", lambda name, data: data))
    assert [(t.name, t.shape, t.type) for t in same.tensors] == [(t.name, t.shape, t.type) for t in load(moe).tensors]


def test_a_router_of_another_width_is_refused_before_loading(moe, tmp_path):
    def wider(name, data):
        return np.concatenate([data, data[:1]], 0) if name == "blk.1.ffn_gate_inp.weight" else data

    bad = rewrite(moe, tmp_path / "router.gguf", wider)
    with pytest.raises(FlexoffloadError, match=r"router blk\.1\.ffn_gate_inp\.weight has shape 128x\d+, not 128x"):
        load(bad)
    r = cli("run", "-m", str(bad), "-p", "x", "-n", "2", "--mem", "1G")
    assert_one_line_error(r, "router blk.1.ffn_gate_inp.weight")
    assert "llama.cpp" not in r.stderr  # ours, before loading: not the loader's


def test_experts_without_a_router_are_refused(moe, tmp_path):
    bad = rewrite(moe, tmp_path / "norouter.gguf",
                  lambda name, data: None if name == "blk.0.ffn_gate_inp.weight" else data)
    assert_one_line_error(cli("info", "-m", str(bad)), "layer 0 has expert tensors but no router")


def test_an_expert_tensor_short_of_an_expert_is_refused(moe, tmp_path):
    bad = rewrite(moe, tmp_path / "exps.gguf", lambda name, data: data[:-1] if name == "blk.1.ffn_up_exps.weight"
                  else data)
    assert_one_line_error(cli("run", "-m", str(bad), "-p", "x", "--mem", "1G"),
                          "blk.1.ffn_up_exps.weight", "equal slices")


def test_a_file_cut_in_the_middle_of_an_expert_is_refused(moe, tmp_path):
    m = load(moe)
    last = max((t for t in m.tensors if t.kind == "expert"), key=lambda t: t.offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(moe.read_bytes()[:last.offset + last.n_bytes // 2])
    assert_one_line_error(cli("run", "-m", str(cut), "-p", "x", "--mem", "1G", "--enforce"), "truncated", last.name)


def test_a_budget_below_the_dense_part_and_a_layer_s_experts_is_refused_naming_the_minimum(moe):
    """The minimum counts the dense part and the experts a prompt's layer holds (the spill): below it, one line."""
    from flexoffload.plan import expertcache

    assert expertcache.memory(load(moe), 0) >= max(expertcache.slot_bytes(load(moe)))  # at least one expert
    r = cli("run", "-m", str(moe), "-p", "x", "-n", "2", "--mem", "4M", "--enforce")
    assert_one_line_error(r, "too small", "the minimum is")
