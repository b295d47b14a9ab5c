"""Operator profiles: the time of each weight-bearing operator (every MUL_MAT and GET_ROWS of a model, by its
weight tensor) as llama.cpp's scheduler runs it, for a decoded token and for a prompt ubatch (OATO's operator parser).

The scheduler's eval callback (ggml_backend_sched_eval_callback) is asked of every node; answering "yes" to all makes
the scheduler compute the graph one node at a time and synchronize the backend after each, so the time between two
observations is one node's compute (plus, for the first node of a split, the copy of its inputs from the other
backend: a transfer). Each node then also pays a graph launch; the median time of the nodes that compute nothing
(views, reshapes) is that launch, and is taken off. Weights are resident for the profile (mmap, warmed by a first
pass): the profile is of compute, the disk has its own (profiler.py).
"""

from __future__ import annotations

import ctypes
import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir, file_key

# struct ggml_tensor in the pinned ggml.h: type (4, padded to 8), buffer (8), ne (4 x 8), nb (4 x 8), op (4),
# op_params (64), flags (4), src (10 x 8), ...
_OFFSET_OP = 8 + 8 + 32 + 32
_OFFSET_SRC = _OFFSET_OP + 4 + 64 + 4
NO_COMPUTE = ("NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE")
WEIGHT_OPS = ("MUL_MAT", "GET_ROWS", "MUL_MAT_ID")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpProfile:
    """Seconds each weight tensor's operator takes on the CPU backend (the median over the timed passes)."""
    decode: dict[str, float]  # one decoded token
    prompt: dict[str, float]  # one ubatch of n_batch prompt tokens
    n_batch: int
    launch_s: float  # what one node's graph launch and sync cost (taken off each time above)
    others_decode_s: float  # everything else a decoded token computes (norms, attention, ...), launches taken off

    def to_dict(self) -> dict:
        return asdict(self)


class _Timer:
    def __init__(self, lib_base):
        self.base = lib_base
        self.samples: dict[str, list[float]] = {}
        self.no_compute: list[float] = []
        self.others = 0.0
        self.last = time.perf_counter()

    def reset(self) -> None:
        self.last = time.perf_counter()

    def __call__(self, t, ask, _user_data) -> bool:
        if ask:
            return True
        now = time.perf_counter()
        dt, self.last = now - self.last, now
        op = self.base.ggml_op_name(ctypes.c_int.from_address(t + _OFFSET_OP).value).decode()
        if op in NO_COMPUTE:
            self.no_compute.append(dt)
            return True
        src0 = ctypes.c_void_p.from_address(t + _OFFSET_SRC).value
        name = self.base.ggml_get_name(src0).decode() if src0 else ""
        if op in WEIGHT_OPS and name.endswith(".weight"):
            self.samples.setdefault(name, []).append(dt)
        else:
            self.others += dt
        return True


def measure(model_path: str, n_threads: int, n_batch: int = 64, n_tokens: int = 8) -> OpProfile:
    """Time the operators in this process: a prompt ubatch of n_batch tokens, then n_tokens decoded ones."""
    from flexoffload import native
    from flexoffload.runtime import engine

    lib = native.llama_cpp()
    timer = _Timer(native.graph_tensors())
    callback = lib.ggml_backend_sched_eval_callback(timer)
    settings = engine.Settings(n_ctx=max(256, n_batch + n_tokens + 16), n_batch=n_batch, n_threads=n_threads,
                               strategy="mmap", temp=0)
    with engine.Engine(model_path, settings, eval_callback=callback) as eng:
        n_vocab = lib.llama_vocab_n_tokens(eng.vocab)
        prompt = [i % n_vocab for i in range(1, n_batch + 1)]
        eng._decode(prompt)  # warm: every page of the weights read in once
        lib.llama_memory_clear(lib.llama_get_memory(eng.ctx), True)
        timer.samples.clear()
        timer.reset()
        eng._decode(prompt)
        prompt_times = {k: v[-1] for k, v in timer.samples.items()}
        timer.samples.clear()
        timer.no_compute.clear()
        timer.others = 0.0
        for i in range(n_tokens):
            timer.reset()
            eng._decode([(7 * i + 3) % n_vocab])
    if not timer.samples:
        raise FlexoffloadError(f"no weight operator was seen while timing {model_path}")
    launch = statistics.median(timer.no_compute) if timer.no_compute else 0.0
    decode = {k: max(statistics.median(v) - launch, 0.0) for k, v in timer.samples.items()}
    prompt_times = {k: max(v - launch, 0.0) for k, v in prompt_times.items()}
    return OpProfile(decode=decode, prompt=prompt_times, n_batch=n_batch, launch_s=launch,
                     others_decode_s=timer.others / n_tokens)


def cached(model, n_threads: int, n_batch: int = 64, remeasure: bool = False) -> OpProfile:
    """measure() in a child process (a model of its own), cached per model file, threads and batch."""
    import sys

    from flexoffload.native import process

    path = cache_dir() / "ops" / f"{file_key(model.path)}-t{n_threads}-b{n_batch}-v1.json"
    if path.exists() and not remeasure:
        return OpProfile(**json.loads(path.read_text()))
    log.info("timing each operator of %s as llama.cpp's scheduler runs it, %d threads (once, cached): under a "
             "minute for a model of a few GB", model.path.name, n_threads)
    r = process.run([sys.executable, "-m", "flexoffload.measure.opprofile", str(model.path), str(n_threads),
                     str(n_batch)], 1800)
    if r.returncode != 0:
        last = [line for line in r.stderr.splitlines() if line.strip()][-1:] or [f"exit {r.returncode}"]
        raise FlexoffloadError(f"timing the operators of {model.path.name} failed: {last[0]}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(r.stdout)
    return OpProfile(**json.loads(r.stdout))


def main() -> None:
    import sys

    try:
        if sys.argv[1] == "--device":  # one server's first device
            from flexoffload import native

            native.spin_briefly()
            model_path, endpoint, n_threads, budget = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
            print(json.dumps(measure_device(model_path, endpoint, n_threads, budget or None)))
            return
        model_path, n_threads, n_batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        print(json.dumps(measure(model_path, n_threads, n_batch).to_dict()))
    except FlexoffloadError as e:
        print(f"flexoffload: {e}", file=sys.stderr)
        sys.exit(1)


# --- a device's profile: how its compute and its link compare with this machine's --------------------------------

DEVICE_PROMPT = "def quicksort(arr):\n"
DEVICE_TOKENS = 24
DEVICE_CTX, DEVICE_BATCH = 256, 64


def device_layers(n_layer: int) -> tuple[int, ...]:
    """The -ngl values a device is timed at: the output head alone, a third, two thirds, everything."""
    return (1, (n_layer + 1) // 3, 2 * (n_layer + 1) // 3, n_layer + 1)


def _decode_seconds(model_path: str, n_threads: int, rpc: tuple[str, ...] = (), n_gpu_layers: int = 0,
                    placed: tuple[tuple[str, str], ...] = ()) -> float:
    """Seconds a decoded token takes with the trailing n_gpu_layers layers on the RPC devices (all weights in
    memory, read in: a device's arrive in pieces, patch 0012): the faster of two generations."""
    from flexoffload.runtime import engine

    settings = engine.Settings(n_ctx=DEVICE_CTX, n_batch=DEVICE_BATCH, n_threads=n_threads, strategy="stream", temp=0,
                               rpc=rpc, n_gpu_layers=n_gpu_layers, placed_patterns=placed)
    with engine.Engine(model_path, settings) as eng:
        best = min(eng.generate(DEVICE_PROMPT, DEVICE_TOKENS).decode_tok_s for _ in range(2))
    return 1.0 / best


def device_configs(model, budget: int | None) -> list[tuple[str, object]]:
    """The placements a device is timed with, those its budget holds (as the placers count a device's memory, at
    the profile's context): -ngl runs visit it once a token; every block's ffn_down there (-ot; attention on the
    host) visits it once a block (as many blocks' as fit)."""
    from flexoffload.measure.probe import measure
    from flexoffload.memory.footprint import costs as run_costs
    from flexoffload.plan.placement import Placement, device_bytes

    costs = run_costs(measure(model, DEVICE_CTX, DEVICE_BATCH)) if budget is not None else {}

    def fits(p) -> bool:
        return budget is None or device_bytes(model, p, costs["kv_cache"], costs["compute"])[0] <= budget

    configs = [(f"-ngl {n}", Placement("profile", ("RPC0",), n)) for n in device_layers(model.n_layer)]
    configs = [(name, p) for name, p in configs if fits(p)]
    downs: list[tuple[str, str]] = []
    for t in model.tensors:
        if t.kind == "ffn_down" and fits(Placement("profile", ("RPC0",), 0, (), tuple(downs + [(t.name, "RPC0")]))):
            downs.append((t.name, "RPC0"))
    if len(configs) < 2 or len(downs) < 2:
        raise FlexoffloadError(f"a device of {budget / (1 << 20):.1f} MiB cannot hold enough of {model.path.name} "
                               f"to be profiled (two placements of layers and two blocks' ffn_down)")
    return configs + [(f"ffn_down of {len(downs)} blocks", Placement("profile", ("RPC0",), 0, (), tuple(downs)))]


def measure_device(model_path: str, endpoint: str, n_threads: int, budget: int | None = None) -> dict:
    """The profile of an RPC server's (first) device (placement.DeviceProfile's fields), from whole tokens as
    llama.cpp's scheduler runs them: the model all on the host, then each of device_configs. With host_X and
    device_X the cost model's compute of the operators each side runs (the host's scaled to the all-host run),
        s_X - host_X - bytes_X / bandwidth = ratio * device_X + visit * visits_X,
    and least squares over the configurations give the device's compute ratio and its visit's cost; the bandwidth
    is its link's (devices.measure_link). Per-operator timing through the eval callback would pay a round trip per
    node on RPC, larger than most nodes' compute, so whole tokens are timed instead."""
    from flexoffload.gguf.model import load
    from flexoffload.measure import profiler
    from flexoffload.native import devices
    from flexoffload.plan.placement import DeviceProfile, Placement, Walk

    model = load(model_path)
    configs = device_configs(model, budget)
    link = devices.measure_link(endpoint)
    bandwidth = min(link.send_bw, link.recv_bw)
    host_profile = profiler.measure(model, n_threads)
    unit = [DeviceProfile("RPC0", 1.0, 0.0, bandwidth)]
    s_a = _decode_seconds(model_path, n_threads)
    scale = s_a / Walk(model, Placement("profile", ("RPC0",)), unit, host_profile).host  # measured over modelled
    device = devices.probe_rpc(endpoint)[0].name
    rows = []  # (config, seconds measured, what the device computes in the cost model's terms, visits)
    for name, placement in configs:
        placed = tuple((f"^{n.replace('.', chr(92) + '.')}$", device) for n, _ in placement.placed)
        s = _decode_seconds(model_path, n_threads, (endpoint,), placement.n_gpu_layers, placed)
        walk = Walk(model, placement, unit, host_profile)
        rows.append((name, s, s - scale * walk.host - walk.transfer_s, walk.compute[0], walk.visits))
    # least squares of y = ratio * device + visit * visits, no intercept
    sxx = sum(r[3] * r[3] for r in rows)
    sxv = sum(r[3] * r[4] for r in rows)
    svv = sum(r[4] * r[4] for r in rows)
    sxy = sum(r[3] * r[2] for r in rows)
    svy = sum(r[4] * r[2] for r in rows)
    det = sxx * svv - sxv * sxv
    ratio = max((sxy * svv - svy * sxv) / det, 0.05)
    visit = max((svy * sxx - sxy * sxv) / det, 0.0)
    return {"name": "", "compute_ratio": ratio, "visit_s": visit, "bandwidth": bandwidth,
            "measured": {"host_s": s_a, "host_scale": scale, "latency_s": link.latency_s,
                         "runs": [{"config": n, "seconds": s, "visits": v} for n, s, _, _, v in rows]}}


def device_cached(model, endpoint: str, n_threads: int, remeasure: bool = False, budget: int | None = None) -> dict:
    """measure_device in a child process (llama.cpp aborts the process when an RPC server fails), cached per model
    file, server and threads (a budget only limits what is placed to time it); the profile's name is left for the
    caller (the device's buffer type)."""
    import sys

    from flexoffload.native import process

    safe = endpoint.replace(":", "_")
    path = cache_dir() / "devices" / f"{file_key(model.path)}-{safe}-t{n_threads}-v3.json"
    if path.exists() and not remeasure:
        return json.loads(path.read_text())
    log.info("profiling the device of the RPC server at %s with %s: a run of the model with each of a few "
             "placements (once per model and server, cached; `flexoffload profile -m MODEL --ops --rpc %s` does it "
             "ahead): about a minute", endpoint, model.path.name, endpoint)
    r = process.run([sys.executable, "-m", "flexoffload.measure.opprofile", "--device", str(model.path), endpoint,
                     str(n_threads), str(budget or 0)], 1800)
    if r.returncode != 0:
        from flexoffload.native import devices

        raise FlexoffloadError(devices.failure([endpoint], "its device profile ran", r.stderr, r.returncode))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(r.stdout)
    return json.loads(r.stdout)


if __name__ == "__main__":
    main()
