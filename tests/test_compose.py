"""Features that compose (issue 40, item 4): each pair of {streaming under a budget, -md, free drafters, -ub/-fa/KV
types, -cnv, a mixture of experts, --plan, --rpc, --precision auto, --sparsity, serve} either runs with greedy
tokens equal to the reference, or is refused in one line by a documented rule (docs/options.md). The reference:
llama-completion on the file the run ran, with the same context settings; for a conversation, the same
conversation by that file alone (no budget, no speculation). Tiny synthetic models, random weights; the budget's
dense model has FFN matrices over the 1 MiB that always stays resident, and its budget a few MiB over the least the
pair's command takes, so that its plan streams them and every pair with the budget that runs reads them from disk:
with --sparsity its level's groups, with --precision auto the lowered file's, with --rpc what neither this machine's
budget nor the server's holds.

With FLEXOFFLOAD_MATRIX=FILE the matrix is written there as a markdown table (scripts/options_doc --matrix FILE
puts it into docs/options.md)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import cli
from test_equality import llama_completion
from flexoffload import rules
from flexoffload.bench import machines
from flexoffload.gguf import synth
from flexoffload.gguf.model import load

FEATURES = ("budget", "md", "free", "ub-fa-kv", "cnv", "moe", "plan", "rpc", "precision", "sparsity", "serve")
PROMPT = "a b c d a b c d a b"  # repeats: n-grams find drafts
N = 10
# heads of 32: a q8_0 KV cache's blocks divide them
DENSE = dataclasses.replace(synth.SHAPES["qwen2-tiny"], n_head=4)  # a dense qwen2: predicted neurons need one
MOE = dataclasses.replace(synth.SHAPES["qwen3moe-tiny"], n_head=4, n_head_kv=2)
DRAFT = dataclasses.replace(DENSE, n_layer=1)  # the target's vocabulary
# the budget's dense model: FFN matrices of 1.6 MB (over SMALL_BYTES, so streamable), attention's under it (resident);
# 19 MB, its vocabulary the draft's
STREAMED = dataclasses.replace(DENSE, n_embd=1024, n_ff=2816)
# and the budget's mixture of experts: MOE's 16 experts of 512 over a width of 1024 (4.5 MiB a layer's expert tensor;
# the tiny MOE's experts are held whole at any budget), 29 MB
STREAMED_MOE = dataclasses.replace(MOE, n_embd=1024, n_ff_expert=512)
# the budget of a pair with "budget": this over the least its command takes, less than what the streamed models stream
STREAM_MARGIN_MIB = 4
# budget + precision's own streamed model: --precision auto measures each group of tensors at each lower type first
# (a requantized file's KL divergence and UQEst each: 10-25 s on a busy 2 cores, small model or not), 48 on STREAMED
# (8 kinds, 3 layer groups, Q3_K and Q2_K: minutes). This one's width, 1088, is no multiple of the K-quants' 256, so
# only ffn_down (rows of n_ff) can take a type below Q4_0: 4 measurements over its 2 layers. Its FFN of 4096 keeps
# gate and up at 2.5 MB, streamed whatever the walk lowers (ffn_down at Q2_K is 1.5 MB, streamable too); heads of 136.
STREAMED_PRECISION = dataclasses.replace(STREAMED, n_layer=2, n_embd=1088, n_ff=4096, n_head=8)
# and its budget over the least of the file it is given (the file the walk writes is smaller: it fits); 2 layers leave
# less to stream than 3 (its plan, ffn_down at Q2_K, streamed 9.6, 7.6 and 2.8 MiB at 0, 2 and 4 MiB over the least)
PRECISION_MARGIN_MIB = 2
# budget + rpc: the server's budget (--mem cpu=...,rpc0=12M), by --placement layers its trailing layers that fit: one of
# STREAMED's 6 MiB layers (8 MiB hold none, 16 two), so this machine streams what neither holds. The server's own 512
# MiB would hold the whole model, nothing streamed; a server in a cgroup of 12 MiB (a budget of about 10 MiB by
# placers.device_budget) was killed while its device profile ran (which peaked at 18 MiB on a server given 10 MiB)
SERVER_BUDGET_MIB = 12
# refusals that depend on the model rather than on the flags (said where the model is read)
MODEL_RULES = {"predicted neurons are built for a dense": "predicted neurons are groups of a dense FFN's "
               "neurons; a mixture of experts has no dense FFN to group"}
RESULTS: dict[tuple[str, str], str] = {}
# what each pair is expected to do: runs equal to the reference, unless listed here, refused by the rule whose message
# (or model rule's) says so, or by click where the command has no such option (the options table says which)
REFUSED = {
    ("md", "rpc"): "--rpc and -md", ("md", "sparsity"): "--sparsity: not with",
    ("cnv", "sparsity"): "--sparsity: not with", ("moe", "sparsity"): "predicted neurons are built for a dense",
    ("plan", "precision"): "--precision auto plans precision", ("rpc", "precision"): "--precision auto plans precision",
    ("precision", "sparsity"): "--sparsity: not with", ("rpc", "sparsity"): "--sparsity: not with",
    ("plan", "sparsity"): "No such option", ("precision", "serve"): "No such option",
    ("sparsity", "serve"): "No such option",
}
DOC = os.path.join(os.path.dirname(__file__), "..", "docs", "options.md")


def expected(a: str, b: str) -> str:
    """"equal", or "refused: " and words of the refusal."""
    return f"refused: {REFUSED[(a, b)]}" if (a, b) in REFUSED else "equal"


@pytest.fixture(scope="module")
def models(module_cache, tmp_path_factory):
    """The pairs' models, in a cache of this module's own: their profiles and plans are measured here, and nothing
    recorded here reaches another module's plans."""
    d = tmp_path_factory.mktemp("compose")
    paths = {"dense": synth.write(d / "dense.gguf", DENSE, output_scale=4.0), "moe": synth.write(d / "moe.gguf", MOE),
             "draft": synth.write(d / "draft.gguf", DRAFT, seed=1),
             "streamed": synth.write(d / "streamed.gguf", STREAMED, output_scale=4.0),
             "streamed-moe": synth.write(d / "streamed-moe.gguf", STREAMED_MOE),
             "streamed-precision": synth.write(d / "streamed-precision.gguf", STREAMED_PRECISION, output_scale=4.0)}
    # predicted neurons, measured once for the dense model (as test_sparsity.py does) and for the streamed one (budget
    # + sparsity: 6 groups of 352 neurons, a layer's group tensors of 1.2 MB and 2.3 MB (Q8_0 down), which a plan
    # streams)
    for name, levels in (("dense", "4,6"), ("streamed", "4")):  # the streamed one's --sparsity 4 alone
        cli("profile", "-m", str(paths[name]), "--neurons", "--neuron-groups", "6", "--levels", levels, "-t", "2",
            check=True)
    return paths


@pytest.fixture
def endpoint():
    """An RPC machine of its own for each pair that takes one (a network namespace running ggml-rpc-server)."""
    with machines.Machines(1, memory=512 << 20, rate="1gbit") as m:
        yield m.endpoints[0]


def _flags(features: tuple[str, ...], models, endpoint) -> tuple[list[str], dict]:
    """The command line of a pair of features (run's flags; how it runs in `how`)."""
    # the budget's own models where it is a feature (--precision auto's: STREAMED_PRECISION)
    model = "moe" if "moe" in features else "dense"
    if "budget" in features:
        model = "streamed-moe" if model == "moe" else "streamed-precision" if "precision" in features else "streamed"
    how = {"model": models[model], "chat": "cnv" in features, "plan": "plan" in features,
           "serve": "serve" in features}
    flags = {"-c": "256", "-b": "32", "-t": "2"}
    if "budget" in features or "plan" in features or "precision" in features:
        flags.update({"--mem": "160M", "--strategy": "stream"})  # "budget": set to stream by _streaming_budget
    if "md" in features:
        flags.update({"-md": str(models["draft"]), "--draft-always": None})
    if "free" in features:
        flags["--spec-type"] = "ngram-simple"
    elif "budget" in features and "md" not in features:  # auto speculates where a plan streams: asked for by md, free
        flags["--spec-type"] = "none"
    if "ub-fa-kv" in features:
        flags.update({"-ub": "16", "-fa": "on", "-ctk": "q8_0", "-ctv": "q8_0"})
    if "rpc" in features:
        flags.update({"--rpc": endpoint, "-ngl": "1"})
        if "budget" in features:  # the trailing layers the server's budget holds (auto may place none there)
            flags["--placement"] = "layers"
    if "precision" in features:
        flags.update({"--precision": "auto", "--max-kld": "0.5"})
    if "sparsity" in features:
        flags["--sparsity"] = "4"
    return [x for k, v in flags.items() for x in ([k] if v is None else [k, v])], how


def _context(flags: list[str]) -> dict:
    """The context settings among flags, for the reference."""
    pairs = dict(zip(flags, flags[1:] + [""]))  # each flag and what follows it
    return {"ctx": int(pairs["-c"]), "batch": int(pairs["-b"]), "ubatch": int(pairs["-ub"]) if "-ub" in pairs else None,
            "flash_attn": pairs.get("-fa"), "kv": pairs.get("-ctk")}


def _reference(path, flags: list[str]) -> str:
    c = _context(flags)
    extra = ["-ctk", c["kv"], "-ctv", c["kv"]] if c["kv"] else []
    if extra:  # llama_completion takes no KV types: run llama-completion with them here
        from flexoffload import native

        cmd = [str(native.tool("llama-completion")), "-m", str(path), "-p", PROMPT, "-n", str(N), "--temp", "0",
               "-c", str(c["ctx"]), "-b", str(c["batch"]), "-ub", str(c["ubatch"] or c["batch"]), "-t", "2",
               "-lm", "mmap", "--no-repack", "-no-cnv", "--no-display-prompt", "--simple-io", "--no-warmup",
               "-fa", c["flash_attn"] or "auto", *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                           env={**os.environ})
        assert r.returncode == 0 and r.stdout.endswith("\n\n"), r.stderr[-2000:]
        return r.stdout[:-2]
    return llama_completion(path, PROMPT, N, ctx=c["ctx"], batch=c["batch"], ubatch=c["ubatch"],
                            flash_attn=c["flash_attn"])


def _chat(model, flags: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flexoffload", "run", "-cnv", "-m", str(model), "-n", "6", "--temp",
                           "0", "--json", *flags], input="hello there\nand again\n", capture_output=True, text=True,
                          timeout=600)


def _serve_text(model, flags: list[str]) -> tuple[int, str, str, float]:
    """Serve with flags, one greedy /completion; (exit status, its text, stderr, the bytes it read from disk)."""
    serve_flags = [f for f in flags if f not in ("--draft-always",)]
    proc = subprocess.Popen([sys.executable, "-m", "flexoffload", "serve", "-m", str(model), "--port", "0", "-np",
                             "1", *serve_flags], stderr=subprocess.PIPE, text=True)
    try:
        port, log = None, ""
        deadline = time.monotonic() + 300
        while port is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            log += line
            if "serving" in line and "http://" in line:
                port = int(line.split("http://", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])
        if port is None:
            proc.wait(timeout=30)
            return proc.returncode, "", log, 0.0
        body = json.dumps({"prompt": PROMPT, "n_predict": N, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            content = json.loads(r.read())["content"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
            metrics = r.read().decode()
        read = [float(x.split()[1]) for x in metrics.splitlines()
                if x.startswith("flexoffload_disk_read_bytes_total ")]
        return 0, content, log, read[0] if read else 0.0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _refused(stderr: str) -> str:
    """The one-line refusal in stderr, checked to be a documented rule's."""
    lines = [x for x in stderr.strip().splitlines() if x.startswith(("Error:", "flexoffload:", "Usage:"))]
    assert "Traceback" not in stderr, stderr[-3000:]
    last = lines[-1] if lines else stderr.strip().splitlines()[-1]
    text = last.removeprefix("Error: ").removeprefix("flexoffload: ")
    documented = [r.message for r in rules.RULES] + list(MODEL_RULES) + ["No such option"]
    assert any(d in text for d in documented), f"refused, but by no documented rule: {text}"
    return text


@pytest.mark.parametrize("a,b", list(itertools.combinations(FEATURES, 2)))
def test_a_pair_runs_as_the_reference_or_is_refused_by_a_rule(a, b, models, request, tmp_path):
    """Each pair does what REFUSED and the table say of it: equal, or refused by that rule."""
    _pair(a, b, models, request, tmp_path)
    got, want = RESULTS[(a, b)], expected(a, b)
    why = want.removeprefix("refused: ")
    assert got == want if want == "equal" else (got.startswith("refused: ") and why in got), \
        f"{a} + {b}: {got}, expected {want}"
    if "budget" in (a, b) and got == "equal":
        assert READ[(a, b)] > 0, f"{a} + {b} ran under its budget, but read nothing from disk: nothing streamed"


def _least_mib(command: list[str]) -> int:
    """The least budget command takes, in MiB, read from its refusal of 1 MiB."""
    r = subprocess.run([sys.executable, "-m", "flexoffload", *command], capture_output=True, text=True, timeout=300,
                       stdin=subprocess.DEVNULL)
    assert r.returncode != 0 and "the minimum is " in r.stderr, r.stderr[-2000:]
    from flexoffload.memory import budgets

    least = r.stderr.split("the minimum is ")[1].split(":")[0].split("\n")[0].strip().replace(" ", "")
    return -(-budgets.parse_size(least) // (1 << 20))


def _streaming_budget(flags: list[str], how: dict, tmp_path) -> list[str]:
    """flags with --mem a few MiB over the least the pair's command takes with them: a budget the plan streams
    under (checked by the bytes the run read). With --rpc, the host's (cpu=) beside the server's SERVER_BUDGET_MIB.
    With --precision auto, the least of the file it is given (asked under 1 MiB, the walk finds no point that fits
    and names no least)."""
    at = flags.index("--mem") + 1
    server = f",rpc0={SERVER_BUDGET_MIB}M" if "--rpc" in flags else ""

    def mem(mib: int) -> str:
        return f"cpu={mib}M{server}" if server else f"{mib}M"

    probe = flags[:at] + [mem(1)] + flags[at + 1:]
    margin = STREAM_MARGIN_MIB
    if "--precision" in probe:
        at_precision = probe.index("--precision")
        assert probe[at_precision + 2] == "--max-kld"
        probe = probe[:at_precision] + probe[at_precision + 4:]  # less --precision auto --max-kld X
        margin = PRECISION_MARGIN_MIB
    model = ["-m", str(how["model"])]
    if how["plan"]:
        command = ["plan", *model, *probe, "-o", str(tmp_path / "least")]
    elif how["serve"]:
        command = ["serve", *model, "--port", "0", "-np", "1", *[f for f in probe if f != "--draft-always"]]
    elif how["chat"]:
        command = ["run", "-cnv", *model, "-n", "6", *probe]
    else:
        command = ["run", *model, "-p", PROMPT, "-n", str(N), *probe]

    def at_budget(mib: int) -> list[str]:
        return [mem(mib) if x == mem(1) else x for x in command]

    least = _least_mib(command)
    if server:  # the least under 1 MiB places more on the server than a larger budget does: asked again
        again = subprocess.run([sys.executable, "-m", "flexoffload", *at_budget(least + margin)], capture_output=True,
                               text=True, timeout=300, stdin=subprocess.DEVNULL)
        if again.returncode != 0 and "the minimum is " in again.stderr:
            least = _least_mib(at_budget(least + margin))
    return flags[:at] + [mem(least + margin)] + flags[at + 1:]


# the streamed bytes a pair with "budget" read: run --json's stream_bytes_read (a mixture of experts' and a sparsity
# level's by expert too), serve's disk reads per pass, a conversation's planned streamed MiB (its --json gives no
# timings)
READ: dict[tuple[str, str], float] = {}


def _pair(a, b, models, request, tmp_path):
    flags, how = _flags((a, b), models, request.getfixturevalue("endpoint") if "rpc" in (a, b) else None)
    model = how["model"]
    if "budget" in (a, b):
        flags = _streaming_budget(flags, how, tmp_path)
    if how["plan"]:
        made = cli("plan", "-m", str(model), *flags, "-o", str(tmp_path / "plan"))
        if made.returncode != 0:
            RESULTS[(a, b)] = "refused: " + _refused(made.stderr)
            return
        flags = flags + ["--plan", str(tmp_path / "plan")]
    if how["serve"]:
        status, text, log, read = _serve_text(model, flags)
        if status != 0 and not text:
            RESULTS[(a, b)] = "refused: " + _refused(log)
            return
        assert text == _reference(model, flags)
        READ[(a, b)] = read
        RESULTS[(a, b)] = "equal"
        return
    if how["chat"]:
        r = _chat(model, flags)
        if r.returncode != 0:
            RESULTS[(a, b)] = "refused: " + _refused(r.stderr)
            return
        ran = json.loads(r.stdout)
        assert ("spec" in ran) == bool({"md", "free"} & {a, b})  # it speculated where asked, not elsewhere
        alone = _chat(ran["model"]["path"], _context_flags(flags))
        assert alone.returncode == 0, alone.stderr
        assert [t["reply"] for t in ran["turns"]] == [t["reply"] for t in json.loads(alone.stdout)["turns"]]
        READ[(a, b)] = ran["plan"]["streamed_mb"] if ran.get("plan") else 0
        RESULTS[(a, b)] = "equal"
        return
    r = cli("run", "-m", str(model), "-p", PROMPT, "-n", str(N), "--temp", "0", "--json", *flags)
    if r.returncode != 0:
        RESULTS[(a, b)] = "refused: " + _refused(r.stderr)
        return
    ran = json.loads(r.stdout)
    assert ("spec" in ran) == bool({"md", "free"} & {a, b})  # it speculated where asked, not elsewhere
    assert ran["text"] == _reference(ran["model"]["path"], flags)
    READ[(a, b)] = ran["timings"].get("stream_bytes_read", 0)
    if "--precision" in flags and "budget" in (a, b):  # and the file run is the one the walk lowered
        assert ran["plan"]["precision"]["types"], ran["plan"]
    if "--rpc" in flags and "budget" in (a, b):  # and the server holds what this machine neither holds nor streams
        host = (ran["plan"]["resident_mb"] + ran["plan"]["streamed_mb"]) * (1 << 20)
        assert host < load(model).weight_bytes - (1 << 20), f"the server holds none of the weights: {ran['plan']}"
    RESULTS[(a, b)] = "equal"


def _context_flags(flags: list[str]) -> list[str]:
    """The context settings among flags (the reference conversation runs the file alone with them)."""
    keep = ("-c", "-b", "-ub", "-fa", "-ctk", "-ctv", "-t")
    return [x for i in range(0, len(flags)) if flags[i] in keep for x in flags[i:i + 2]]


def matrix_cells(text: str) -> dict[tuple[str, str], str]:
    """The matrix of docs/options.md (between its markers): each pair's cell, "equal" or "refused"."""
    block = text.split("<!-- matrix -->", 1)[1].split("<!-- /matrix -->", 1)[0]
    lines = [line for line in block.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    cells = {}
    for line in lines[1:]:
        row, *values = [c.strip() for c in line.strip("|").split("|")]
        cells.update({(row, col): v for col, v in zip(columns, values) if v})
    return cells


def test_the_documented_matrix_is_the_tested_one():
    """docs/options.md's matrix says of every pair what this test expects of it (refresh: FLEXOFFLOAD_MATRIX and
    scripts/options_doc --matrix)."""
    with open(DOC) as f:
        doc = matrix_cells(f.read())
    want = {(a, b): expected(a, b).split(":")[0] for a, b in itertools.combinations(FEATURES, 2)}
    assert doc == want
    assert all(b in FEATURES and a in FEATURES for a, b in REFUSED)


def test_a_refusal_expected_by_the_command_line_is_an_option_the_command_lacks():
    """"No such option" is expected exactly where the options table gives the command no such flag."""
    from flexoffload import options

    flag_of = {"sparsity": "sparsity", "precision": "precision"}
    command_of = {"plan": "plan", "serve": "serve"}
    for (a, b), why in REFUSED.items():
        if why != "No such option":
            continue
        [command] = [command_of[x] for x in (a, b) if x in command_of]
        [feature] = [flag_of[x] for x in (a, b) if x in flag_of]
        assert command not in options.BY_NAME[feature].commands


def test_write_the_matrix():
    """The matrix the pairs made, written where FLEXOFFLOAD_MATRIX says (after the pairs: pytest runs in order)."""
    out = os.environ.get("FLEXOFFLOAD_MATRIX")
    if not out or not RESULTS:
        pytest.skip("FLEXOFFLOAD_MATRIX not set, or the pairs did not run in this session")
    rows = ["| | " + " | ".join(FEATURES[1:]) + " |", "|---" * len(FEATURES) + "|"]
    for i, a in enumerate(FEATURES[:-1]):
        cells = []
        for b in FEATURES[1:]:
            got = RESULTS.get((a, b)) if FEATURES.index(b) > i else None
            cells.append("" if got is None else ("equal" if got == "equal" else "refused"))
        rows.append(f"| {a} | " + " | ".join(cells) + " |")
    refusals = sorted({f"- {a} + {b}: {v.removeprefix('refused: ')}" for (a, b), v in RESULTS.items()
                       if v != "equal"})
    with open(out, "w") as f:
        f.write("\n".join(rows) + "\n\nRefused pairs and the rule each met:\n\n" + "\n".join(refusals) + "\n")
