"""Mixed precision (issue 17): lower types a tensor can take, the requantized file, measured harm, the planner."""

import dataclasses
import json
import math

import numpy as np
import pytest

from conftest import cli
from flexoffload import FlexoffloadError
from flexoffload.plan import mixed
from flexoffload.gguf import catalog
from flexoffload.plan import qtypes
from flexoffload.measure import requantize
from flexoffload.measure import sensitivity
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.native import tools
from flexoffload.plan.qtypes import Row, Sensitivity
from test_equality import llama_completion

# 256-wide rows take K-quants; Q4_0 weights leave two lower types (Q3_K, Q2_K) per group: a short profile
SHAPE = synth.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=1024)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Requantized files, importance matrices and profiles in a test's own cache (the native build linked in)."""
    from flexoffload.defaults import cache_dir

    native = cache_dir() / "native"
    (tmp_path / "cache").mkdir()
    if native.is_dir():
        (tmp_path / "cache" / "native").symlink_to(native)
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    return load(synth.write(tmp_path_factory.mktemp("models") / "wide.gguf", SHAPE))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Original F32 weights and the Q4_0 file llama-quantize makes of them, as the models here are made."""
    d = tmp_path_factory.mktemp("pair")
    original = synth.write(d / "original.gguf", SHAPE, qtype="F32", seed=3)
    tools.run("llama-quantize", [str(original), str(d / "file.gguf"), "Q4_0", "2"], timeout=300)
    return load(original), load(d / "file.gguf")


def header(name):
    entry = catalog.CATALOG[name]
    if not catalog.is_present(entry):
        pytest.fail(f"{name} is not fetched: run `flexoffload models fetch` (make test does)")
    return load(catalog.model_path(entry))


def tensor(model, name):
    return next(t for t in model.tensors if t.name == name)


def test_candidates_are_the_lower_types_whose_blocks_fit_the_rows():
    target = header(catalog.DEFAULT_MODEL)
    assert tensor(target, "blk.0.ffn_down.weight").type == "Q6_K"
    assert qtypes.candidates(tensor(target, "blk.0.ffn_down.weight")) == ["Q5_K", "Q5_0", "Q4_K", "Q4_0", "Q3_K",
                                                                             "Q2_K"]
    assert qtypes.candidates(tensor(target, "blk.0.attn_q.weight")) == ["Q3_K", "Q2_K"]
    assert qtypes.candidates(tensor(target, "blk.0.attn_norm.weight")) == []
    draft = header(catalog.DRAFT_MODEL)  # 896-wide rows: only the 32-weight types
    assert qtypes.candidates(tensor(draft, "blk.0.attn_q.weight")) == ["Q4_0"]
    assert qtypes.candidates(tensor(draft, "blk.0.attn_v.weight")) in (["Q5_0", "Q4_0"], ["Q4_0"])


def test_a_group_offers_one_type_per_size():
    target = header(catalog.DEFAULT_MODEL)
    gs = sensitivity.groups(target, 4)
    names = {g.name for g in gs}
    assert {"ffn_down@0-6:Q6_K", "ffn_down@0-6:Q4_K", "attn_q@21-27:Q4_K", "output:Q6_K"} <= names
    assert sum(len(g.tensors) for g in gs) == sum(qtypes.quantizable(t) for t in target.tensors)
    down = next(g for g in gs if g.name == "ffn_down@0-6:Q6_K")
    assert sensitivity.group_candidates(target, down) == ["Q5_K", "Q4_K", "Q3_K", "Q2_K"]  # not Q5_0, Q4_0 too


def test_check_names_the_tensor_and_why():
    draft = header(catalog.DRAFT_MODEL)
    with pytest.raises(FlexoffloadError, match=r"blk\.0\.attn_q\.weight cannot take Q3_K: its rows are 896 weights"):
        qtypes.check(tensor(draft, "blk.0.attn_q.weight"), "Q3_K")
    with pytest.raises(FlexoffloadError, match="Q8_K has no dot product in the CPU backend"):
        qtypes.check(tensor(draft, "blk.0.ffn_down.weight"), "Q8_K")
    with pytest.raises(FlexoffloadError, match="IQ2_XS needs an importance matrix"):
        qtypes.check(tensor(draft, "blk.0.ffn_down.weight"), "IQ2_XS")
    with pytest.raises(FlexoffloadError, match="not a weight matrix"):
        qtypes.check(tensor(draft, "blk.0.attn_norm.weight"), "Q4_0")
    with pytest.raises(FlexoffloadError, match="Q9_K is not a ggml type"):
        qtypes.check(tensor(draft, "blk.0.ffn_down.weight"), "Q9_K")
    with pytest.raises(FlexoffloadError, match="has no tensor blk.99"):
        qtypes.validate(draft, {"blk.99.ffn_down.weight": "Q4_0"})


def test_requantize_changes_the_plan_s_tensors_only(wide, cache):
    types = {"blk.0.ffn_down.weight": "Q3_K", "blk.1.attn_q.weight": "Q2_K"}
    path = requantize.requantize(wide, types)
    out = load(path)
    assert {t.name: t.type for t in out.tensors if t.type != tensor(wide, t.name).type} == types
    assert out.weight_bytes == qtypes.mixed_bytes(wide, types) < wide.weight_bytes
    for name in ("blk.0.ffn_up.weight", "token_embd.weight", "blk.1.attn_norm.weight"):  # copied byte for byte
        a, b = tensor(wide, name), tensor(out, name)
        with open(wide.path, "rb") as f, open(path, "rb") as g:
            f.seek(a.offset)
            g.seek(b.offset)
            assert f.read(a.n_bytes) == g.read(b.n_bytes)
    stamp = path.stat().st_mtime_ns
    assert requantize.requantize(wide, types) == path and path.stat().st_mtime_ns == stamp  # cached by its inputs
    assert requantize.requantize(wide, {"blk.0.ffn_down.weight": "Q2_K"}) != path


def test_a_failed_requantization_leaves_no_file(pair, cache, tmp_path):
    original, file = pair
    cut = tmp_path / "cut.gguf"  # a whole header, the weights cut short
    cut.write_bytes(original.path.read_bytes()[:original.file_size // 2])
    with pytest.raises(FlexoffloadError, match="GGUF file is truncated"):
        requantize.requantize(file, {"blk.0.ffn_down.weight": "Q3_K"}, original=cut)
    matrix = tmp_path / "bad.imatrix.gguf"  # llama-quantize starts, then fails reading it
    matrix.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(FlexoffloadError, match="llama-quantize failed"):
        requantize.requantize(file, {"blk.0.ffn_down.weight": "Q3_K"}, matrix, original.path)
    assert not list((cache / "mixed").iterdir())


def test_quantizing_from_the_original_loses_less_than_requantizing(pair, cache):
    original, file = pair
    types = {t.name: "Q3_K" for t in file.tensors if qtypes.quantizable(t) and t.layer is not None}
    twice, once = requantize.requantize(file, types), requantize.requantize(file, types, original=original.path)
    assert {t.name: t.type for t in load(once).tensors} == {t.name: t.type for t in load(twice).tensors}
    a, b = tensor(file, "token_embd.weight"), tensor(load(once), "token_embd.weight")  # not lowered: Q4_0 again
    with open(file.path, "rb") as f, open(once, "rb") as g:
        f.seek(a.offset)
        g.seek(b.offset)
        assert f.read(a.n_bytes) == g.read(b.n_bytes)
    text = sensitivity.calibration_text()
    base = sensitivity.kld_base(original, text, n_ctx=256, n_chunks=2)
    harm = {path: sensitivity.kld(path, base, text, n_ctx=256, n_chunks=2)["kld"] for path in (once, twice)}
    assert 0 < harm[once] < harm[twice]


def test_the_original_must_be_the_file_s_weights_unquantized(pair, wide, cache, tmp_path):
    original, file = pair
    other = synth.write(tmp_path / "other.gguf", dataclasses.replace(SHAPE, n_ff=768), qtype="F32")
    differs = r"other.gguf is not the original of file.gguf: blk.0.ffn_\w+.weight is (768x256|256x768), not"
    for path, message in ((wide.path, r"wide.gguf is quantized \(\S+ is Q4_0\)"), (other, differs)):
        with pytest.raises(FlexoffloadError, match=message):
            requantize.check_original(file, path)
    r = cli("plan", "-m", str(file.path), "--mem", "120M", "--max-kld", "0.1", "--original", str(original.path),
            "-o", "x")
    assert r.returncode != 0 and "go with --precision auto" in r.stderr
    r = cli("plan", "-m", str(file.path), "--mem", "120M", "--precision", "auto", "--original", str(wide.path),
            "-o", "x")  # refused before the profile is measured
    assert r.returncode != 0 and "wide.gguf is quantized" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_kl_divergence_is_zero_against_itself_and_grows_with_fewer_bits(wide, cache):
    text = sensitivity.calibration_text()
    base = sensitivity.kld_base(wide, text, n_ctx=256, n_chunks=2)
    own = sensitivity.kld(wide.path, base, text, n_ctx=256, n_chunks=2)
    assert own["kld"] < 1e-5 and own["same_top"] == 1.0 and own["ppl"] == pytest.approx(own["ppl_base"])
    matrices = [t.name for t in wide.tensors if qtypes.quantizable(t) and t.layer is not None]
    harm = {}
    for ty in ("Q3_K", "Q2_K"):
        path = requantize.requantize(wide, {n: ty for n in matrices})
        harm[ty] = sensitivity.kld(path, base, text, n_ctx=256, n_chunks=2)["kld"]
    assert 0 < harm["Q3_K"] < harm["Q2_K"]


def test_uqest_is_the_mean_entropy_of_the_greedy_continuation(wide):
    assert sensitivity.entropy(np.zeros(10, dtype=np.float32)) == pytest.approx(math.log(10))
    assert sensitivity.entropy(np.array([0.0, -1e4], dtype=np.float32)) == pytest.approx(0.0, abs=1e-9)
    from flexoffload.runtime import engine

    u = sensitivity.uqest(wide.path, ["def add(a, b):"], n_predict=12, n_threads=2)
    assert 0 < u["uqest"] <= math.log(SHAPE.n_vocab)
    with engine.Engine(str(wide.path), engine.Settings(n_ctx=1024, temp=0.0, n_threads=2)) as e:
        greedy = e.generate("def add(a, b):", 12)
    assert u["tokens"][0] == greedy.tokens[:len(u["tokens"][0])]


def fake_profile(model):
    """Two groups: cheap lowers harm little per byte, costly lowers harm a lot."""
    def row(group, ty, saved, kld):
        return Row(group, group.split("@")[0], 0, 0, "Q4_0", ty, [f"blk.0.{group.split('@')[0]}.weight"], saved,
                   kld, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0)

    rows = [row("ffn_up@0-0", "Q3_K", 100, 0.001), row("ffn_up@0-0", "Q2_K", 200, 0.004),
            row("attn_q@0-0", "Q3_K", 100, 0.01), row("attn_q@0-0", "Q2_K", 200, 0.05)]
    return Sensitivity(model.path.name, 1, ["Q3_K", "Q2_K"], 1.0, 1.0, rows)


def test_the_walk_lowers_the_least_harm_per_byte_first(wide):
    sens = fake_profile(wide)
    w = mixed.walk(wide, sens, lambda m: 1e6 / m.weight_bytes)
    assert [p.steps[-1] for p in w.points[1:]] == [("ffn_up@0-0", "Q3_K"), ("ffn_up@0-0", "Q2_K"),
                                                   ("attn_q@0-0", "Q3_K"), ("attn_q@0-0", "Q2_K")]
    assert [round(p.kld, 4) for p in w.points] == [0, 0.001, 0.004, 0.014, 0.054]
    assert all(a.predicted_tok_s < b.predicted_tok_s for a, b in zip(w.points, w.points[1:]))
    assert w.points[-1].types == {"blk.0.ffn_up.weight": "Q2_K", "blk.0.attn_q.weight": "Q2_K"}
    assert mixed.choose(w, 0.02, None) is w.points[3]
    assert mixed.choose(w, None, w.points[2].predicted_tok_s) is w.points[2]
    with pytest.raises(FlexoffloadError, match=r"the fastest is [\d.]+ tok/s \(KL divergence 0.0540\)"):
        mixed.choose(w, None, 1e9)
    with pytest.raises(FlexoffloadError, match="not both"):
        mixed.choose(w, 0.1, 1.0)
    # the uniform alternatives: every group at Q3_K keeps more bytes than the walk's second point, at more harm
    w.alternatives = mixed.uniform(wide, sens, lambda m: 1e6 / m.weight_bytes)
    q3 = next(p for p in w.alternatives if p.steps == (("all", "Q3_K"),))
    assert q3.kld == pytest.approx(0.011) and q3.weight_bytes > w.points[2].weight_bytes
    assert mixed.choose(w, 0.012, None) is w.points[2]
    w.points = w.points[:2]  # a walk cut short: the alternative is faster within the bound, and taken
    assert mixed.choose(w, 0.012, None) is q3


def test_plan_precision_auto_writes_a_file_that_runs_as_llama_cpp_runs_it(wide, cache, tmp_path, tiny_model):
    out = tmp_path / "plan"
    r = cli("plan", "-m", str(wide.path), "--mem", "120M", "--precision", "auto", "--max-kld", "0.01", "-t", "2",
            "-o", str(out), "--json", check=True)
    p = json.loads(r.stdout)
    record = p["precision"]
    assert record["source"] == str(wide.path) and record["predicted_kld"] <= 0.01 and record["types"]
    assert {t.name: t.type for t in load(p["model"]).tensors if t.name in record["types"]} == record["types"]
    assert record["measured"]["kld"] >= 0 and record["measured"]["held_out_ppl"] > 0
    assert [x["kld"] for x in p["walk"]] == sorted(x["kld"] for x in p["walk"])
    # the plan runs its own file; greedy tokens equal llama.cpp's on that file
    ours = json.loads(cli("run", "--plan", str(out), "-p", "def add(a, b):", "-n", "16", "--temp", "0", "-t", "2",
                          "--mem", "120M", "--enforce", "--json", check=True).stdout)  # a child in a cgroup too
    assert ours["text"] == llama_completion(p["model"], "def add(a, b):", 16)
    other = cli("run", "-m", str(tiny_model), "--plan", str(out), "-p", "x", "-n", "1")
    assert other.returncode != 0 and "made for wide.gguf" in other.stderr


def test_precision_errors_are_one_line(wide, cache):
    """Each error is one line; bad input is refused before anything is measured, and an error that only a
    measurement can find (no plan that fast) comes after the notices of what was measured, still one line."""
    for args, message in (
            (["plan", "--mem", "120M", "--precision", "auto", "--min-tok-s", "1e9", "-o", "x"],
             "the fastest is"),
            (["plan", "--mem", "120M", "--max-kld", "0.1", "-o", "x"], "go with --precision auto"),
            (["profile", "--precision", "--types", "Q4_K,Q9_K"], "Q9_K is not a ggml type"),
            (["profile", "--precision", "--types", "Q4_K,Q8_K"], "Q8_K has no dot product in the CPU backend"),
            (["profile", "--precision", "--groups", "0"], "--groups must be between 1"),
            (["run", "--precision", "auto", "-p", "x"], "under --mem")):
        r = cli(*args[:1], "-m", str(wide.path), *args[1:])
        lines = r.stderr.strip().splitlines()
        # notices ("flexoffload: measuring ...", and the profile's warning where the machine was busy) are not errors
        errors = [line for line in lines if not line.startswith("flexoffload: ")]
        assert r.returncode != 0 and message in r.stderr and len(errors) == 1, r.stderr
        assert len(lines) == 1 or message == "the fastest is", r.stderr  # measured only where it must be


def test_speculation_with_a_mixed_target_is_lossless(wide, cache, tmp_path):
    """run -md --precision auto: the target's plan leaves the draft its memory; greedy tokens are the mixed file's own."""
    draft = synth.write(tmp_path / "draft.gguf", synth.Shape(n_layer=1, n_embd=256, n_ff=256, n_head=4, n_head_kv=2,
                                                              n_vocab=384, n_ctx_train=1024), seed=1)
    prompt = "def add(a, b):"
    r = json.loads(cli("run", "-m", str(wide.path), "-md", str(draft), "--mem", "150M", "--precision", "auto",
                       "--max-kld", "0.01", "-p", prompt, "-n", "16", "--temp", "0", "-t", "2", "--draft-always",
                       "--json", check=True).stdout)
    mixed_file = r["model"]["path"]
    assert r["plan"]["precision"]["types"] and r["plan"]["precision"]["source"] == str(wide.path) != mixed_file
    assert r["n_gen"] == 16 and r["text"] == llama_completion(mixed_file, prompt, 16)
