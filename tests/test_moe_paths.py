"""A mixture of experts (synthetic, random weights, real shapes) on the paths a user runs it by: `run --enforce`, the
child in a memory cgroup at the budget, whose plan counts the expert cache and whose cgroup's own peak counter stays
within the budget; and a streamed run's greedy text against llama-completion itself on the same file (test_moe.py
compares a streamed run with our own mmap run)."""

import dataclasses
import json

import pytest
from conftest import cli, set_profile
from test_equality import llama_completion

from flexoffload import api
from flexoffload.cli import request_from_args
from flexoffload.gguf import synth
from flexoffload.gguf.model import load
from flexoffload.measure import probe, profiler
from flexoffload.plan import expertcache
from flexoffload.plan.planners import run_minimum

MiB = 1 << 20
MOE = ["llama-moe-tiny", "qwen3moe-tiny"]
# embeddings and output over the 1 MiB that always stays resident, so a plan streams them beside the experts
STREAMED = {"llama-moe-tiny": dict(n_embd=512, n_ff=512, n_vocab=4096),
            "qwen3moe-tiny": dict(n_embd=512, n_ff_expert=256, n_vocab=4096)}
SEED = {"llama-moe-tiny": 0, "qwen3moe-tiny": 1}  # weights whose greedy text after PROMPT is not one token repeated
PROMPT = "hello world"
SETTING = ["-c", "256", "-b", "32", "-t", "2"]
TOK_S = 50.0  # the compute set for the profiles below


def _write(name, directory):
    return synth.write(directory / f"{name}.gguf", dataclasses.replace(synth.SHAPES[name], **STREAMED[name]),
                       seed=SEED[name], output_scale=4.0)


# experts of 0.84 MiB (16 a layer), and an output matrix of 18 MiB (a 32000-token vocabulary): at a budget the
# expert cache is a fifth of, a plan that did not count the cache would keep the output resident in its memory
ENFORCED = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_embd=1024, n_ff_expert=512, n_vocab=32000)


def test_a_moe_under_enforce_stays_within_its_budget_and_its_plan_counts_the_expert_cache(tmp_path, private_cache):
    """A qwen3moe at its least budget and room for 8 cached experts a layer, the disk set four times slower than
    compute (set in this test's own cache, not measured). The plan counts the experts' memory (the cache's slots and
    a batch's experts beyond them) and the runtime's expert cache fits in it. `run --enforce` holds the child to the
    budget in a cgroup: it runs to its end, reads experts as the routing asks, and the cgroup's peak counter (page
    cache included) is within the budget. The kernel holds any run there, so the same plan runs again in a cgroup
    with room to spare (the file's pages charged to this process first): the counter's peak is within what the plan
    predicts the run cannot give back, the budget kept without the kernel's reclaim. Counting no expert memory,
    the plan keeps the output resident instead and the run holds 9 MiB more than it predicts."""
    path = synth.write(tmp_path / "moe.gguf", ENFORCED, seed=1)
    m = load(path)
    set_profile(path, 2, TOK_S, disk_bw=m.weight_bytes * TOK_S / 4)
    slots = 8
    budget = run_minimum(m, probe.measure(m, 256, 32)) + 2 * (expertcache.memory(m, slots) - expertcache.memory(m, 0))
    flags = ["-m", str(path), "--mem", str(budget), *SETTING, "--strategy", "stream", "--expert-reads", "routed",
             "--expert-slots", str(slots), "--spec-type", "none", "-p", PROMPT, "-n", "16", "--temp", "0"]
    prepared = api.prepare(request_from_args(flags))
    plan = prepared.plan
    assert plan is not None and plan.experts is not None and prepared.limit == budget
    experts = {t.name for t in m.tensors if t.kind == "expert"}
    assert experts <= set(plan.streamed)
    assert plan.memory.experts >= expertcache.memory(m, slots, 32) > expertcache.memory(m, 0, 32) > 0
    assert plan.memory.unreclaimable <= budget

    r = cli("run", *flags, "--enforce", "--json")
    assert r.returncode == 0, r.stderr
    enforced = json.loads(r.stdout)
    assert enforced["enforced"] and enforced["peak_source"] == "cgroup" and enforced["budget_mb"] * MiB == budget
    assert 0 < enforced["peak_mem_mb"] * MiB <= budget
    assert enforced["plan"]["unreclaimable_mb"] == pytest.approx(plan.memory.unreclaimable / MiB)  # this plan ran
    t = enforced["timings"]
    assert t["expert_uses"] > 0 and t["expert_bytes_read"] > 0
    assert 0 < t["expert_cached_peak"] <= plan.memory.experts

    profiler.warm_page_cache(path)  # its pages charged here, not to the run's cgroup
    roomy = api.run_in_cgroup(prepared, budget + (512 << 20), timeout=300)
    assert roomy["tokens"] == enforced["tokens"]
    assert roomy["peak_unreclaimable_mb"] <= roomy["peak_mem_mb"]
    assert roomy["peak_mem_mb"] * MiB <= plan.memory.unreclaimable <= budget, \
        (roomy["peak_mem_mb"], plan.memory.unreclaimable / MiB, budget / MiB)


@pytest.mark.parametrize("reads", ["routed", "whole"])
@pytest.mark.parametrize("name", MOE)
def test_a_moe_streamed_writes_llama_completion_s_greedy_text(name, reads, tmp_path, private_cache):
    """Streamed at its least budget (experts by expert once the router has chosen, or whole by the window), the
    greedy text is the one this build's llama-completion writes for the same file (mmap, upstream's path), with the
    same context and batch (a text of several tokens, not one repeated: a wrong expert read shows); and the run did
    read from the disk, by expert where routed."""
    path = _write(name, tmp_path)
    m = load(path)
    set_profile(path, 2, TOK_S, disk_bw=m.weight_bytes * TOK_S / 4)
    budget = int(run_minimum(m, probe.measure(m, 256, 32)) * 1.02)
    r = cli("run", "-m", str(path), "-p", PROMPT, "-n", "24", "--temp", "0", *SETTING, "--mem", str(budget),
            "--strategy", "stream", "--expert-reads", reads, "--spec-type", "none", "--json")
    assert r.returncode == 0, r.stderr
    ours = json.loads(r.stdout)
    t = ours["timings"]
    assert ours["strategy"] == "stream" and t["stream_bytes_read"] > 0
    if reads == "routed":
        assert t["expert_uses"] > 0 and t["expert_bytes_read"] > 0
    else:
        assert not t.get("expert_uses")
    theirs = llama_completion(path, PROMPT, 24, ctx=256, batch=32)
    assert len(set(theirs.split())) >= 3
    assert ours["text"] == theirs


# --- the runtime's accounting of expert reads ------------------------------------------------------------------------

def _by_expert(path, slots: int, prompt: str = PROMPT, room: int = 0, more: tuple[str, ...] = ()):
    """A streamed run of the file prepared near its least budget (and `room` bytes more), its experts read by
    expert, `slots` of them a layer cached between tokens, `more` flags after the others: (the Prepared, the
    Model)."""
    m = load(path)
    set_profile(path, 2, TOK_S, disk_bw=m.weight_bytes * TOK_S / 4)
    budget = int(run_minimum(m, probe.measure(m, 256, 32)) * 1.02)  # room for embeddings and output: resident
    budget += 2 * (expertcache.memory(m, slots) - expertcache.memory(m, 0)) + room
    flags = ["-m", str(path), "--mem", str(budget), *SETTING, "--strategy", "stream", "--expert-reads", "routed",
             "--expert-slots", str(slots), "--spec-type", "none", "-p", prompt, "-n", "16", "--temp", "0", *more]
    return api.prepare(request_from_args(flags)), m


@pytest.mark.parametrize("n_layer", [2, 1])  # 1: one streamed group, where a pass was not counted before
def test_each_pass_reads_a_token_s_routed_experts_once_whatever_the_layers(n_layer, tmp_path, private_cache):
    """Only the experts stream (one streamed group a layer), none cached between tokens (--expert-slots 0): each
    decode pass reads each layer's k routed experts once, the prompt's pass up to all of them; the runtime counts a
    pass a forward pass and a use a routed expert of a layer in a pass, every use a read of one expert's slices."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=n_layer, **STREAMED["qwen3moe-tiny"])
    prepared, m = _by_expert(synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"]), 0)
    experts = {t.name for t in m.tensors if t.kind == "expert"}
    assert set(prepared.plan.streamed) == experts  # only the experts stream: a group a layer
    t = api.run_in_cgroup(prepared, None, timeout=300)["timings"]  # a fresh process: its counters its own
    decoded, k = 16 - 1, m.n_expert_used  # the last token is not decoded
    unit = sum(x.n_bytes for x in m.tensors if x.kind == "expert") // m.n_expert // m.n_layer
    assert t["stream_passes"] == decoded + 1 and t["expert_hit_rate"] == 0
    assert n_layer * (k * decoded + k) <= t["expert_uses"] <= n_layer * (k * decoded + m.n_expert)
    assert t["expert_bytes_read"] == t["expert_uses"] * unit


@pytest.mark.parametrize("batch", [("-b", "8"), ("-b", "32", "-ub", "8")])
def test_a_prompt_in_several_ubatches_reads_each_expert_once_a_ubatch(batch, tmp_path, private_cache):
    """A prompt in several ubatches of 8 tokens (passes), one a batch or four: each pass reads each expert its
    tokens name at a layer once, for all of the layer's expert ops (gate, up and down take the one read), and
    nothing else. With no expert kept between passes (--expert-slots 0) and no token decoded (-n 1): the bytes read
    are the uses times one expert's slices, and each pass uses between k and all of each layer's experts. A batch's
    ubatches before its last output nothing, so llama.cpp skips their last layer's FFN: on 2 layers a pass then
    enters the first layer's group alone, and is counted by its tensors' order (it was not before)."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=2, **STREAMED["qwen3moe-tiny"])
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"], routing="text")
    prompt = " ".join(f"word{i} thing{i * 7}" for i in range(4))
    prepared, m = _by_expert(path, 0, prompt, more=(*batch, "-n", "1"))
    r = api.run_in_cgroup(prepared, None, timeout=300)
    t, passes = r["timings"], -(-r["n_prompt"] // 8)
    assert passes >= 3 and t["stream_passes"] == passes
    unit = sum(x.n_bytes for x in m.tensors if x.kind == "expert") // m.n_expert // m.n_layer
    assert t["expert_hit_rate"] == 0 and t["expert_bytes_read"] == t["expert_uses"] * unit
    assert passes * m.n_layer * m.n_expert_used <= t["expert_uses"] <= passes * m.n_layer * m.n_expert


def test_the_expert_cache_peak_of_a_run_is_its_own_in_a_process_that_ran_others(tmp_path, private_cache):
    """The same Prepared run twice in this process: the same routing, the same cache, the same peak, within the
    experts' memory the plan counted. Without lookahead: whether a wrong prediction's read had begun when its layer's
    router chose (then it is read) or not (dropped) is the disk's timing, so its bytes read may differ run to run."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], **STREAMED["qwen3moe-tiny"])
    prepared, _ = _by_expert(synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"]), 4)
    prepared = dataclasses.replace(prepared, settings=dataclasses.replace(prepared.settings, expert_lookahead=False))
    first, second = api.run_prepared(prepared)["timings"], api.run_prepared(prepared)["timings"]
    assert first["expert_uses"] == second["expert_uses"] and first["expert_bytes_read"] == second["expert_bytes_read"]
    assert second["expert_cached_peak"] == first["expert_cached_peak"] <= prepared.plan.memory.experts


def test_a_layer_s_slots_hold_its_cache_and_a_prompt_batch_s_experts_are_given_back_after_it(tmp_path,
                                                                                              private_cache):
    """Routed as text, a prompt batch names most of each layer's experts, read into the layer's slots (patch 0025),
    those beyond its cache into the spill array the layers share in turn (patch 0027); after the layer the cache
    keeps `slots` of them, moved down to the array's first slots, and after the pass the spill's pages are given
    back. So at the run's end the memory the runtime holds grows with the slots kept, not with the prompt's
    experts: two more slots a layer hold two more experts a layer (each in whole pages), the same tokens. Before
    the slots are given back, both held about all of the prompt's experts alike; the smaller cache spilled more."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=3, **STREAMED["qwen3moe-tiny"])
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"], routing="text")
    prompt = " ".join(f"word{i} thing{i * 7}" for i in range(12))
    prepared, m = _by_expert(path, 4, prompt=prompt)
    fewer = dataclasses.replace(prepared, settings=dataclasses.replace(prepared.settings, expert_slots=2))
    four, two = (api.run_in_cgroup(p, None, timeout=300) for p in (prepared, fewer))
    assert four["tokens"] == two["tokens"] and four["n_prompt"] >= 24
    unit = sum(x.n_bytes for x in m.tensors if x.kind == "expert") // m.n_expert // m.n_layer
    slot = expertcache.slot_bytes(m)[0]
    held = four["timings"]["stream_committed"] - two["timings"]["stream_committed"]
    assert m.n_layer * 2 * unit <= held <= m.n_layer * 2 * slot
    assert four["timings"]["expert_cached_peak"] >= m.n_expert // 2 * unit  # the prompt's batch held more
    assert four["timings"]["expert_spilled"] >= m.n_layer  # every layer's prompt batch went past its cache
    assert two["timings"]["expert_spilled"] > four["timings"]["expert_spilled"]


def _ahead(model, slots: int) -> int:
    """What reading ahead adds to expertcache.memory(): while a prompt batch's layer computes, the next layer holds
    all of its experts beside its slots (patch 0022). No plan counts it (no plan reads ahead), so it lives here."""
    sizes = expertcache.slot_bytes(model)
    return max(max(model.n_expert - slots, 0) * sizes[il] for il in expertcache.expert_layers(model))


def test_a_prompt_batch_reads_the_next_layer_s_experts_ahead_and_keeps_what_it_would_have_kept(tmp_path,
                                                                                             private_cache):
    """Routed as text (a token's experts follow the token), a prompt of a few dozen tokens names most experts of
    each of the 3 layers in a batch, so each layer reads all of the next one's experts ahead while it computes
    (patch 0022), and gives back at once those its own batch then did not use. Against the same Prepared without
    reading ahead, in fresh processes: the same tokens, experts used and hits (an expert read ahead is a miss its
    layer did not wait for: the cache keeps the same experts), no fewer bytes read; the cached experts' peak no
    lower, within what the plan counts and the next layer's experts beside it (_ahead). No plan turns it
    on yet (on the 30B-A3B shape a run with it left its budget), so the run sets it itself."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=3, **STREAMED["qwen3moe-tiny"])
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"], routing="text")
    room = _ahead(load(path), 4)
    planned, m = _by_expert(path, 4, prompt=" ".join(f"word{i} thing{i * 7}" for i in range(12)), room=room)
    assert not planned.settings.expert_ahead and not planned.plan.experts.ahead  # no plan turns it on yet
    prepared = dataclasses.replace(planned, settings=dataclasses.replace(planned.settings, expert_ahead=True))
    without = planned
    ahead, alone = (api.run_in_cgroup(p, None, timeout=300) for p in (prepared, without))
    assert ahead["n_prompt"] >= 24 and ahead["tokens"] == alone["tokens"]
    a, b = ahead["timings"], alone["timings"]
    assert (a["expert_uses"], a["expert_hit_rate"]) == (b["expert_uses"], b["expert_hit_rate"])
    assert a["expert_ahead"] >= (m.n_layer - 1) * m.n_expert and b["expert_ahead"] == 0
    assert a["expert_bytes_read"] >= b["expert_bytes_read"]
    assert b["expert_cached_peak"] <= a["expert_cached_peak"] <= prepared.plan.memory.experts + room


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "gpt-oss-tiny"])  # softmax routers; top k of biased logits
def test_a_decoded_token_s_layer_reads_the_next_layer_s_predicted_experts(name, tmp_path, private_cache):
    """Routed as text (each layer's router reads the slice of the residual stream the token's embedding writes),
    layer l's router input through layer l+1's router predicts most of l+1's experts. Where a token's experts fit
    in the slots the plan turns lookahead on (patch 0029): each decoded token's layers read the next layer's
    predicted experts while they compute. Against the same Prepared without (in fresh processes): the same tokens
    and experts used; experts read on a prediction, most of which their layer's router then chose (a random guess
    gets k/n of them); none without; the cached experts' peak within what the plan counts (a prediction takes the
    slots of experts given back for it, never more)."""
    shape = dataclasses.replace(synth.SHAPES[name], n_layer=4, **STREAMED.get(name, {}))
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED.get(name, 0), routing="text")
    prompt = " ".join(f"word{i} thing{i * 7}" for i in range(6))
    m = load(path)
    planned, _ = _by_expert(path, m.n_expert_used + 2, prompt=prompt)
    assert planned.plan.experts.lookahead and planned.settings.expert_lookahead
    without = dataclasses.replace(planned, settings=dataclasses.replace(planned.settings, expert_lookahead=False))
    ahead, alone = (api.run_in_cgroup(p, None, timeout=300) for p in (planned, without))
    assert ahead["tokens"] == alone["tokens"]
    a, b = ahead["timings"], alone["timings"]
    assert a["expert_uses"] == b["expert_uses"]
    decoded = len(ahead["tokens"]) - 1
    assert a["expert_predicted"] > 0 and b["expert_predicted"] == 0
    assert a["expert_predicted"] <= decoded * (m.n_layer - 1) * m.n_expert_used  # a token's k, the last layer none
    assert a["expert_predicted_used"] >= 0.6 * a["expert_predicted"]
    assert a["expert_cached_peak"] <= planned.plan.memory.experts


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "gpt-oss-tiny"])  # softmax routers; top k of biased logits
def test_a_layer_s_reads_are_queued_at_its_router_s_choice(name, tmp_path, private_cache):
    """From the second pass on, a layer's experts not in memory are queued when its router's argsort is done
    (llama.cpp's ffn_moe_argsort-<layer>), a few ops before its first expert op (patch 0031). Against the same
    Prepared with that off (fresh processes; lookahead off in both, so every miss is the router's): the same tokens,
    experts used and bytes read; experts queued at the router with it, none without, and those are every miss but
    the prompt's pass's, which are queued at its expert ops (the layer is recognised there)."""
    shape = dataclasses.replace(synth.SHAPES[name], n_layer=3, **STREAMED.get(name, {}))
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED.get(name, 0))
    m = load(path)
    planned, _ = _by_expert(path, m.n_expert_used + 2)
    planned = dataclasses.replace(planned, settings=dataclasses.replace(planned.settings, expert_lookahead=False))
    assert planned.settings.expert_router
    off = dataclasses.replace(planned, settings=dataclasses.replace(planned.settings, expert_router=False))
    routed, alone = (api.run_in_cgroup(p, None, timeout=300) for p in (planned, off))
    assert routed["tokens"] == alone["tokens"]
    a, b = routed["timings"], alone["timings"]
    assert (a["expert_uses"], a["expert_bytes_read"]) == (b["expert_uses"], b["expert_bytes_read"])
    misses = round(a["expert_uses"] * (1 - a["expert_hit_rate"]))
    first = m.n_layer * min(m.n_expert, m.n_expert_used * routed["n_prompt"])  # the prompt pass's misses at most
    assert b["expert_routed"] == 0 and 0 < a["expert_routed"] <= misses
    assert a["expert_routed"] >= misses - first


def test_a_layer_whose_predictions_its_router_does_not_choose_stops_predicting(tmp_path, private_cache):
    """Random routers (each layer's its own random matrix): layer l's input through layer l+1's router guesses
    l+1's experts about as well as chance, and each wrong guess evicts an expert for nothing. A layer whose router
    chose less than half its predicted experts of late is predicted every 16th pass only (patch 0029): over 48
    teacher-forced tokens, far fewer predictions than a token's k at every layer but the first; the same tokens as
    without lookahead."""
    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=4, **STREAMED["qwen3moe-tiny"])
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"], routing="random")
    m = load(path)
    planned, _ = _by_expert(path, m.n_expert_used + 2)
    forced = " ".join(f"t{i * 13} u{i * 5}" for i in range(40))
    planned = dataclasses.replace(planned, request=dataclasses.replace(planned.request, forced=forced, n_predict=48))
    assert planned.settings.expert_lookahead
    without = dataclasses.replace(planned, settings=dataclasses.replace(planned.settings, expert_lookahead=False))
    ahead, alone = (api.run_in_cgroup(p, None, timeout=300) for p in (planned, without))
    assert ahead["tokens"] == alone["tokens"] and len(ahead["tokens"]) == 48
    a = ahead["timings"]
    assert 0 < a["expert_predicted"] < 0.4 * 47 * (m.n_layer - 1) * m.n_expert_used
    assert a["expert_predicted_used"] < 0.5 * a["expert_predicted"]


def test_free_drafters_on_a_moe_streamed_by_expert_keep_its_greedy_text(tmp_path, private_cache):
    """Free drafters (n-grams, Token Recycling) asked for by name on a MoE streamed by expert: a tree's tokens each
    route to their own experts, the pass reads their union, and the tokens are the target's alone; trees were
    drafted and verified. `--spec-type auto` does not speculate on a MoE (drafting.free_pays): it runs the target
    alone."""
    path = _write("qwen3moe-tiny", tmp_path)
    prepared, m = _by_expert(path, 4, prompt="a b c a b c a b c a b c")
    # a node's cost (a share of the profile's compute a token) is weighed against the measured pass, so with the
    # profile's 20 ms a token an idle machine's fast passes would take no node: compute set 100 times faster
    set_profile(path, 2, 100 * TOK_S, disk_bw=m.weight_bytes * TOK_S / 4)
    flags = ["-m", str(path), "--mem", str(prepared.limit), *SETTING, "--strategy", "stream", "--expert-reads",
             "routed", "--expert-slots", "4", "-p", "a b c a b c a b c a b c", "-n", "24", "--temp", "0", "--json"]
    alone = json.loads(cli("run", *flags, "--spec-type", "none", check=True).stdout)
    tree = json.loads(cli("run", *flags, "--spec-type", "ngram-simple,recycle", check=True).stdout)
    assert tree["tokens"] == alone["tokens"] and len(set(alone["text"].split())) >= 2
    assert tree["spec"]["types"] == ["ngram-simple", "recycle"]
    t = tree["timings"]
    assert tree["strategy"] == "stream+tree" and t["n_verify"] <= tree["n_gen"], t
    assert t["n_drafted"] > 0 and t["expert_uses"] > 0, t
    auto = json.loads(cli("run", *flags, "--spec-type", "auto", check=True).stdout)
    assert auto["tokens"] == alone["tokens"] and "spec" not in auto


def test_lookahead_says_once_where_a_saved_plan_streams_the_routers(tmp_path, private_cache):
    """A plan given by --plan that streams the routers, with lookahead on, is told in one note before the run (the
    runtime would skip those layers' predictions silently); the same plan with its routers resident says nothing."""
    from flexoffload.plan import plans

    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=3, **STREAMED["qwen3moe-tiny"])
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"], routing="text")
    prepared, m = _by_expert(path, 4)
    plan = dataclasses.replace(prepared.plan, experts=dataclasses.replace(prepared.plan.experts, lookahead=True))
    routers = tuple(t.name for t in m.tensors if t.kind == "router")
    assert not set(routers) & set(plan.streamed)
    moved = sum(t.n_bytes for t in m.tensors if t.kind == "router")
    blind = dataclasses.replace(plan, streamed=plan.streamed + routers,
                                resident=tuple(n for n in plan.resident if n not in routers),
                                memory=dataclasses.replace(plan.memory, resident=plan.memory.resident - moved))
    said = {}
    for name, saved in (("kept", plan), ("blind", blind)):
        plans.write(saved, tmp_path / name)
        again = api.prepare(request_from_args(["-m", str(path), "--plan", str(tmp_path / name), "-p", PROMPT, "-n",
                                               "4", "--spec-type", "none", "--temp", "0"]))
        assert again.settings.expert_lookahead
        said[name] = [n for n in again.notes if "lookahead" in n]
    assert said["kept"] == []
    assert len(said["blind"]) == 1 and f"streams {len(routers)} of the routers" in said["blind"][0]


def test_lookahead_asked_for_on_the_command_line_and_through_serve(tmp_path, private_cache):
    """--expert-lookahead on and off from `run`: the same tokens, experts read on a prediction with it and none
    without; `serve --expert-lookahead on` starts its llama-server with lookahead on and answers with run's text."""
    import urllib.request

    from test_serve import Serving

    shape = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_layer=4, **STREAMED["qwen3moe-tiny"])
    path = synth.write(tmp_path / "moe.gguf", shape, seed=SEED["qwen3moe-tiny"], routing="text")
    prompt = " ".join(f"word{i} thing{i * 7}" for i in range(6))
    m = load(path)
    slots = m.n_expert_used + 2
    prepared, _ = _by_expert(path, slots, prompt=prompt)
    flags = ["-m", str(path), "--mem", str(prepared.limit), *SETTING, "--strategy", "stream", "--expert-reads",
             "routed", "--expert-slots", str(slots)]
    runs = {x: json.loads(cli("run", *flags, "--expert-lookahead", x, "--spec-type", "none", "-p", prompt, "-n",
                              "12", "--temp", "0", "--json", check=True).stdout) for x in ("on", "off")}
    assert runs["on"]["tokens"] == runs["off"]["tokens"]
    assert runs["on"]["timings"]["expert_predicted"] > 0 == runs["off"]["timings"]["expert_predicted"]
    with Serving(*flags, "--expert-lookahead", "on", "-np", "1") as s:
        environ = open(f"/proc/{s.server_pid}/environ", "rb").read().split(b"\0")
        assert b"LLAMA_STREAM_EXPERT_LOOKAHEAD=1" in environ
        body = json.dumps({"prompt": prompt, "n_predict": 12, "temperature": 0}).encode()
        with urllib.request.urlopen(urllib.request.Request(f"{s.base}/completion", body), timeout=300) as r:
            assert json.loads(r.read())["content"] == runs["on"]["text"]
