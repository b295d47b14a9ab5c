"""The operator profiler (opprofile.py): every weight's operator timed through the scheduler's eval callback."""

import json

from conftest import cli
from flexoffload.measure import opprofile
from flexoffload.gguf import synth
from flexoffload.gguf.model import load

SHAPE = synth.Shape(n_layer=4, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=1024, n_ctx_train=512)


def test_every_weight_operator_is_timed_and_a_ubatch_costs_more(tmp_path):
    path = synth.write(tmp_path / "four.gguf", SHAPE, "F32")
    m = load(path)
    p = opprofile.measure(str(path), n_threads=2, n_batch=64, n_tokens=4)
    matmul_weights = {t.name for t in m.tensors if len(t.shape) == 2 and t.kind not in ("token_embd",)}
    assert matmul_weights <= set(p.decode)  # every matrix the layers and the head multiply by
    assert "token_embd.weight" in p.decode  # its lookup (GET_ROWS)
    assert set(p.prompt) == set(p.decode)
    assert all(s >= 0 for s in p.decode.values()) and p.others_decode_s > 0
    # 64 tokens through a matrix take longer than one: for most matrices, so that a busy machine's stall on a few
    # (another process's reads, its threads) does not decide it
    assert sum(p.decode.values()) > 0
    assert sum(p.prompt[k] > p.decode[k] for k in matmul_weights) > 0.75 * len(matmul_weights)


def test_profile_ops_is_cached_per_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEXOFFLOAD_CACHE", str(tmp_path / "cache"))
    path = synth.write(tmp_path / "four.gguf", SHAPE, "F32")
    first = json.loads(cli("profile", "-m", str(path), "--ops", "-t", "2", "--json", check=True).stdout)
    assert list((tmp_path / "cache" / "ops").glob("*.json"))
    again = json.loads(cli("profile", "-m", str(path), "--ops", "-t", "2", "--json", check=True).stdout)
    assert again == first  # from the cache
    table = cli("profile", "-m", str(path), "--ops", "-t", "2", check=True).stdout
    assert "ffn_down" in table and "a decoded token" in table
