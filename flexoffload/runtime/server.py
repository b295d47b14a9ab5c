"""`flexoffload serve`'s engine: the patched llama-server, started by a plan, behind the HTTP front (runtime/front.py).

The server is llama.cpp's own (tools/server: its slots, continuous batching, chat templates, OpenAI endpoints). It
starts with the run's engine.Settings turned into its flags (the plan's `-ot` lines, -c, -b, -t, the KV types,
--rpc), its own speculation where prepare chose it (Speculation: -md, --spec-type) and the streaming runtime's
settings in its environment (LLAMA_STREAM_*), in a memory cgroup at the budget where one is asked for, and listens
on a unix socket in a private temporary folder: only the front reaches it.
This module runs that process and the serve's life (listen, load, serve, stop); the front forwards the requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import MAP_K_SIZE, NGRAM_SIZES
from flexoffload.memory.budgets import MemoryCgroup
from flexoffload.native import process
from flexoffload.runtime.config import stream_config
from flexoffload.runtime.engine import Settings, drop_file_cache, raise_memlock_limit

QUEUE = 32  # requests that may wait for a slot beyond the N generating (--queue)
STOP_WAIT_S = 3.0  # llama-server's time to exit after SIGTERM, before SIGKILL (it keeps nothing worth waiting for)

# Flags flexoffload serve sets itself: given after `--` they would contradict the plan or the front.
OWN_FLAGS = frozenset({
    "-m", "--model", "-c", "--ctx-size", "-np", "--parallel", "--host", "--port", "--api-key", "--api-key-file",
    "-ot", "--override-tensor", "-lm", "--load-mode", "--mlock", "--no-mmap", "--mmap", "-t", "--threads", "--rpc",
    "-ngl", "--n-gpu-layers", "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", "--kv-unified-per-slot",
    "-fit", "--fit",
    # speculation (serve's -md, --spec-type, --draft-max): the draft's memory and the target's logits rows are planned
    "-md", "--model-draft", "--spec-draft-model", "-hfd", "-hfrd", "--spec-draft-hf", "--hf-repo-draft",
    "--spec-type", "--spec-draft-n-max", "-ngld", "--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft",
    "-devd", "--spec-draft-device", "--device-draft", "-ctkd", "--spec-draft-type-k", "--cache-type-k-draft",
    "-ctvd", "--spec-draft-type-v", "--cache-type-v-draft", "-otd", "--spec-draft-override-tensor",
    "--override-tensor-draft", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m",
    "--spec-ngram-map-k-size-n", "--spec-ngram-map-k-size-m"})

# llama-server's n-gram drafters, given the keys of run's drafters of the same name (speculation/drafters.py): its own
# defaults (a 12-token key) find a match only in long verbatim repeats
NGRAM_KEYS = {"ngram-simple": max(NGRAM_SIZES), "ngram-map-k": MAP_K_SIZE}
DRAFT_TYPE = "draft-simple"  # llama-server's speculation by a draft model (-md alone loads it and drafts nothing)


@dataclass(frozen=True)
class Speculation:
    """llama-server's own speculation: a draft model kept resident (draft: its path, None: none) and the --spec-type
    list (draft-simple for the draft model, ngram-simple, ngram-map-k); n_max: the draft model's tokens a step
    (--spec-draft-n-max), ngram_max: an n-gram match's (the m-gram size). A sequence's verification pass holds
    1 + the larger of them rows."""
    draft: str | None
    types: tuple[str, ...]
    n_max: int = 3
    ngram_max: int = 16

    @property
    def rows(self) -> int:
        """Tokens a sequence's verification pass holds at most: its last token and the longest draft."""
        lengths = [self.n_max] * (DRAFT_TYPE in self.types) + [self.ngram_max] * any(t in NGRAM_KEYS
                                                                                  for t in self.types)
        return 1 + max(lengths, default=0)

    def describe(self) -> str:
        """What speculates, for the ready line."""
        parts = [f"{Path(self.draft).name} drafts {self.n_max}"] if self.draft else []
        parts += [f"{t} up to {self.ngram_max}" for t in self.types if t in NGRAM_KEYS]
        return "speculating: " + ", ".join(parts) + " tokens a step"

    def args(self, settings: Settings) -> list[str]:
        """llama-server's flags: the draft kept whole in memory on this machine (-ngld 0, -devd none: no -ot of the
        target's reaches it), its KV cache of the target's types; always --spec-type (with -md alone llama-server
        loads the draft, finds no type that uses it and frees it)."""
        args = []
        if self.draft:
            args += ["-md", self.draft, "--spec-draft-n-max", str(self.n_max), "-ngld", "0", "-devd", "none",
                     "-ctkd", settings.type_k, "-ctvd", settings.type_v]
        for name, key in NGRAM_KEYS.items():
            if name in self.types:
                flag = name.replace("ngram-", "--spec-ngram-")
                args += [f"{flag}-size-n", str(key), f"{flag}-size-m", str(self.ngram_max)]
        return args + ["--spec-type", ",".join(self.types)]


@dataclass(frozen=True)
class Listen:
    """Where the front listens and what it lets through (--host, --port, --api-key, --queue)."""
    hosts: tuple[str, ...] = ("127.0.0.1",)
    port: int = 8080  # 0: any free port (the ready line names it)
    api_key: str | None = None
    queue: int = QUEUE


def llama_server_args(model: str, settings: Settings, n_parallel: int, socket_path: str,
                      extra: tuple[str, ...] = (), speculation: Speculation | None = None) -> list[str]:
    """llama-server's flags for a run's settings, serving n_parallel sequences that share settings.n_ctx cells;
    speculation: llama-server's own (None: none).

    Each sequence has its own -c / N cells (llama-server's default without --kv-unified): together never more than the
    plan counted, a request too long for its share is a 400 before it runs, and a sequence's cells stay in the order
    of its positions, so its attention sums in the order a lone run's does (in one unified cache, cells freed by
    other requests are reused out of order, and greedy output can differ from run's where two choices nearly tie)."""
    for flag in extra:
        if flag.split("=", 1)[0] in OWN_FLAGS:
            raise FlexoffloadError(f"{flag} is flexoffload serve's own: give it before `--` (see serve -h)")
    if n_parallel < 1 or settings.n_ctx // n_parallel < 16:
        raise FlexoffloadError(f"-np {n_parallel} sequences in -c {settings.n_ctx}: each needs at least 16 cells")
    overrides = [f"{p}=STREAMED" for p in settings.streamed_patterns]
    overrides += [f"{p}={b}" for p, b in settings.placed_patterns]
    for o in overrides:
        if "," in o:  # llama.cpp's -ot splits its value at commas
            raise FlexoffloadError(f"a tensor override llama-server cannot take (a comma): {o}")
    args = ["-m", model, "--host", socket_path, "--port", "8080", "-c", str(settings.n_ctx),
            "-np", str(n_parallel), "-no-kvu",
            "-b", str(settings.n_batch), "-ub", str(settings.n_ubatch or settings.n_batch),
            "-t", str(settings.n_threads), "-tb", str(settings.n_threads), "-fa", settings.flash_attn,
            "-ctk", settings.type_k, "-ctv", settings.type_v,
            # as the engine loads: no repacking (it changes kernels and doubles memory under mmap), resident
            # weights read once and locked; nothing fitted again or cached beside the plan
            "--no-repack", "-lm", "mmap" if settings.strategy == "mmap" else "mlock", "-fit", "off",
            "-cram", "0", "-ctxcp", "0", "--no-warmup", "--metrics", "-ngl", str(settings.n_gpu_layers)]
    for o in overrides:
        args += ["-ot", o]
    if settings.rpc:
        args += ["--rpc", ",".join(settings.rpc)]
    if settings.tensor_split:
        args += ["-ts", ",".join(f"{x:g}" for x in settings.tensor_split)]
    if speculation is not None:
        args += speculation.args(settings)
    if not {"-a", "--alias"} & {f.split("=", 1)[0] for f in extra}:  # the model's name in /v1/models, unless given
        args += ["--alias", Path(model).stem]
    return args + list(extra)


def environment(settings: Settings, speculation: Speculation | None = None, tiled: bool = False) -> dict[str, str]:
    """llama-server's environment: the streaming runtime's configuration (config.stream_config: what engine.Engine
    sets through the C API) as the LLAMA_STREAM_* variables the patched llama.cpp reads; and the kernels (tiled:
    llama.cpp's own)."""
    env = {}
    if not tiled:
        # row-by-row kernels in every pass (patch 0009's switch): with the tiled ones (K-quants from 8 rows) a row
        # rounds by how many rows share its pass (8 requests decoding together, a verification pass's 1 + n_max), so
        # a near tie could flip a greedy token; row by row, a request's text is run's whatever else is served and
        # speculation's is the target alone's. --tiled: llama.cpp's kernels, about a quarter faster for such passes.
        env["GGML_CPU_TILED_MM"] = "0"
    config = stream_config(settings)
    if config is not None:  # what engine.Engine applies through the C API, from the same translation
        env.update(config.environment())
    if settings.rpc:  # as an RPC run's child (native.spin_briefly): spinning threads share the cores
        from flexoffload.native import SPIN_COUNT

        env["GOMP_SPINCOUNT"] = os.environ.get("GOMP_SPINCOUNT", SPIN_COUNT)
    return env


class Child:
    """llama-server as a child process: in its own session (a Ctrl-C reaches the front, which stops it in order), in
    a memory cgroup of limit bytes where limit is given, killed with its parent (setpriv --pdeathsig), its log kept."""

    def __init__(self, cmd: list[str], env: dict[str, str], limit: int | None, verbose: bool):
        self.cgroup = MemoryCgroup(limit) if limit is not None else None
        self.log: collections.deque[str] = collections.deque(maxlen=200)
        self.verbose = verbose
        start = self.cgroup.popen if self.cgroup else process.start
        try:
            self.proc = start(cmd, pdeathsig="TERM", env={**os.environ, **env}, stdin=process.DEVNULL,
                              stdout=process.PIPE, stderr=process.STDOUT, start_new_session=True)
        except BaseException:
            self.close()
            raise
        self._reader = threading.Thread(target=self._read_log, daemon=True)
        self._reader.start()

    def _read_log(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.log.append(line)
            if self.verbose:
                os.write(2, raw)

    def last_error(self) -> str:
        """The log line that says why llama-server stopped (as engine._Log.last_error)."""
        lines = list(self.log)
        for words in (("error loading model",), ("error", "failed", "exception", "invalid")):
            for line in reversed(lines):
                if any(w in line.lower() for w in words):
                    return line.strip()
        return lines[-1].strip() if lines else "no log"

    def disk_read_bytes(self) -> int:
        """The bytes the process has read from storage (/proc/PID/io read_bytes: the streamed reads, O_DIRECT
        included, and what loading read); 0 where the kernel does not count them."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return 0

    def rss(self) -> tuple[int, int]:
        """(now, peak) of the process's resident set (VmRSS, VmHWM): its own memory, without the page cache."""
        fields = {}
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
        return fields.get("VmRSS", 0), fields.get("VmHWM", 0)

    def memory(self) -> tuple[int, int]:
        """(now, peak) bytes: the cgroup's (page cache included) where there is one, else the process's RSS."""
        if not self.cgroup:
            return self.rss()
        name = "memory.current" if self.cgroup.version == "v2" else "memory.usage_in_bytes"
        try:
            now = int((self.cgroup.path / name).read_text())
        except (OSError, ValueError):
            now = 0
        return now, self.cgroup.peak()

    def signal(self, sig: int) -> None:
        """Send sig to the process, if it is still there."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def close(self) -> None:
        """Stop the process if it runs (SIGTERM, then SIGKILL after STOP_WAIT_S) and remove its cgroup."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                proc.wait(STOP_WAIT_S)
            except process.TimeoutExpired:
                self.signal(signal.SIGKILL)
                proc.wait()
        if self.cgroup:
            self.cgroup.__exit__(None, None, None)
            self.cgroup = None


def speculation_refused(log) -> str | None:
    """Why llama-server dropped its speculation, from its log (a draft whose vocabulary is not the target's is only
    logged, and the server then serves without speculating); None where it kept it."""
    for line in log:
        if "failed to initialize speculative decoding" in line:
            return line.strip()
    return None


FOLDER_PREFIX = "flexoffload-serve-"


def _remove_stale_folders() -> None:
    """The temporary folders of serves that were killed (SIGKILL: no cleanup ran), named by their pid."""
    for folder in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name[len(FOLDER_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


@dataclass
class Served:
    """What a serve did, for its last line."""
    requests: int
    cancelled: int
    rejected: int
    peak_mem_mb: float


async def _healthy_unless(front, stop: asyncio.Event) -> bool:
    """Whether llama-server answers its health check; False at once where stop is set first (a llama-server busy
    loading may take the check's whole timeout to answer: a signal then is not left waiting for it)."""
    health = asyncio.ensure_future(front.upstream_healthy())
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({health, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        if not health.done():
            health.cancel()
    if not health.done() or health.cancelled():
        return False
    return health.result()


async def _serve(model: str, settings: Settings, n_parallel: int, listen: Listen, cgroup_limit: int | None,
                 budget: int | None, extra: tuple[str, ...], echo, on_ready,
                 speculation: Speculation | None, tiled: bool) -> Served:
    """serve's life: listen, start llama-server and wait until it answers, serve until a signal, then stop in order
    (the front first: its requests are answered and their upstream connections closed; then llama-server)."""
    from flexoffload import native
    # imported here, not with this module: aiohttp takes 18 MiB, which every `run` (whose api imports this module)
    # would otherwise carry and count against its budget
    from flexoffload.runtime.front import Front

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
        signals.append(sig)
    _remove_stale_folders()
    tmp = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
    child = front = None
    try:
        socket_path = str(Path(tmp) / "llama.sock")
        cmd = [str(native.tool("llama-server")), *llama_server_args(model, settings, n_parallel, socket_path, extra,
                                                                    speculation)]
        front = Front(socket_path, n_parallel, listen, budget)
        try:  # bound first: a port in use is an error before the model loads
            port = await front.open()
        except OSError as e:
            raise FlexoffloadError(f"cannot listen on {','.join(listen.hosts)}:{listen.port}: "
                                   f"{e.strerror or e}") from None
        if settings.strategy != "mmap":
            raise_memlock_limit()
        child = front.child = Child(cmd, environment(settings, speculation, tiled), cgroup_limit, settings.verbose)
        t0 = time.perf_counter()
        while not await _healthy_unless(front, stop):
            if child.proc.poll() is not None:
                raise FlexoffloadError(f"llama-server stopped while loading (exit {child.proc.returncode}): "
                                       f"{child.last_error()}")
            if stop.is_set():
                return Served(0, 0, 0, child.memory()[1] / (1 << 20))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.1)
        if settings.strategy != "mmap":  # as the engine does after loading: the page cache reading left
            drop_file_cache(model)
        front.counts.read_base = child.disk_read_bytes()
        front.ready = True
        refused = speculation_refused(child.log) if speculation else None
        if refused and echo:
            echo(f"flexoffload: llama-server serves without speculation: {refused}")
        if on_ready:
            on_ready(port, time.perf_counter() - t0)
        while not stop.is_set():
            if child.proc.poll() is not None:
                raise FlexoffloadError(f"llama-server stopped (exit {child.proc.returncode}): {child.last_error()}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
        c = front.counts
        return Served(c.requests, c.cancelled, c.rejected, child.memory()[1] / (1 << 20))
    finally:
        if front is not None:
            await front.close()
        if child is not None:
            await loop.run_in_executor(None, child.close)
        shutil.rmtree(tmp, ignore_errors=True)
        for sig in signals:
            loop.remove_signal_handler(sig)


def serve(model: str, settings: Settings, n_parallel: int, listen: Listen, cgroup_limit: int | None = None,
          budget: int | None = None, extra: tuple[str, ...] = (), echo=None, on_ready=None,
          speculation: Speculation | None = None, tiled: bool = False) -> Served:
    """Serve model by settings to n_parallel sequences until SIGINT or SIGTERM, then stop llama-server, remove its
    cgroup and temporary folder. cgroup_limit: llama-server's memory cgroup (None: none); budget: the --mem it
    plans for (reported in /metrics); extra: llama-server's own flags; on_ready(port, load_s) once it answers;
    speculation: llama-server's own (None: none); tiled: llama.cpp's tiled kernels (environment)."""
    return asyncio.run(_serve(model, settings, n_parallel, listen, cgroup_limit, budget, extra, echo, on_ready,
                              speculation, tiled))
