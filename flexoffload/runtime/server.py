"""`flexoffload serve`'s engine: the patched llama-server, started by a plan, behind a thin HTTP front.

The server is llama.cpp's own (tools/server: its slots, continuous batching, chat templates, OpenAI endpoints). It
starts with the run's engine.Settings turned into its flags (the plan's `-ot` lines, -c, -b, -t, the KV types,
--rpc) and the streaming runtime's settings in its environment (LLAMA_STREAM_*), in a memory cgroup at the budget
where one is asked for, and listens on a unix socket in a private temporary folder: only the front reaches it.

The front listens on --host/--port and forwards each request, streaming server-sent events as they come. It adds
what llama-server lacks (docs/serve.md): a body that is not JSON is a 400 (llama-server answers 500); at most N
requests generate at once and a bounded number wait, 503 beyond; the API key is checked before a request waits;
/metrics gains the bytes read from disk per token and per decode pass, the queue and the memory peak; a client that
goes away has its upstream connection closed, which llama-server takes as a cancellation.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import http
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.memory.budgets import MemoryCgroup
from flexoffload.runtime.engine import Settings, drop_file_cache, raise_memlock_limit

# Requests that take a slot while they run (POST): the ones the queue bounds.
GENERATING = frozenset({
    "/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions", "/infill",
    "/responses", "/v1/responses", "/v1/messages", "/embedding", "/embeddings", "/v1/embeddings", "/rerank",
    "/reranking", "/v1/rerank", "/v1/reranking"})
PUBLIC = frozenset({"/health", "/v1/health"})  # answered without the API key, as llama-server does
QUEUE = 32  # requests that may wait for a slot beyond the N generating (--queue)
MAX_BODY = 64 << 20  # bytes of a request body
MAX_HEAD = 64 << 10  # bytes of a request line and headers
STOP_WAIT_S = 3.0  # llama-server's time to exit after SIGTERM, before SIGKILL (it keeps nothing worth waiting for)
POLL_S = 0.05  # how often a waiting request looks whether its client is still there

# Flags flexoffload serve sets itself: given after `--` they would contradict the plan or the front.
OWN_FLAGS = frozenset({
    "-m", "--model", "-c", "--ctx-size", "-np", "--parallel", "--host", "--port", "--api-key", "--api-key-file",
    "-ot", "--override-tensor", "-lm", "--load-mode", "--mlock", "--no-mmap", "--mmap", "-t", "--threads", "--rpc",
    "-ngl", "--n-gpu-layers", "-kvu", "--kv-unified", "-no-kvu", "--no-kv-unified", "--kv-unified-per-slot",
    "-fit", "--fit"})

_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer", "upgrade",
                  "proxy-connection", "expect", "host"})


@dataclass(frozen=True)
class Listen:
    """Where the front listens and what it lets through (--host, --port, --api-key, --queue)."""
    hosts: tuple[str, ...] = ("127.0.0.1",)
    port: int = 8080  # 0: any free port (the ready line names it)
    api_key: str | None = None
    queue: int = QUEUE


def llama_server_args(model: str, settings: Settings, n_parallel: int, socket_path: str,
                      extra: tuple[str, ...] = ()) -> list[str]:
    """llama-server's flags for a run's settings, serving n_parallel sequences that share settings.n_ctx cells.

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
    if not {"-a", "--alias"} & {f.split("=", 1)[0] for f in extra}:  # the model's name in /v1/models, unless given
        args += ["--alias", Path(model).stem]
    return args + list(extra)


def environment(settings: Settings) -> dict[str, str]:
    """The streaming runtime's settings as the patched llama.cpp reads them from the environment (patches 0002,
    0007), what engine.Engine sets through the C API (stream.configure)."""
    env = {}
    if settings.strategy != "mmap":
        env.update(LLAMA_STREAM_WINDOW=str(settings.window), LLAMA_STREAM_IO_THREADS=str(settings.io_threads),
                   LLAMA_STREAM_CHUNK_BYTES=str(settings.chunk_bytes),
                   # a mixture of experts' cache (patch 0018; stream.configure_experts): -1, all it read
                   LLAMA_STREAM_EXPERT_SLOTS=str(settings.expert_slots),
                   LLAMA_STREAM_EXPERT_WHOLE=str(int(settings.expert_whole)))
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
        pdeath = [shutil.which("setpriv"), "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []
        kwargs = dict(env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                      stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self.proc = self.cgroup.popen(pdeath + cmd, **kwargs) if self.cgroup else subprocess.Popen(pdeath + cmd,
                                                                                                       **kwargs)
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
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def close(self) -> None:
        """Stop the process if it runs (SIGTERM, then SIGKILL after STOP_WAIT_S) and remove its cgroup."""
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                proc.wait()
        if self.cgroup:
            self.cgroup.__exit__(None, None, None)
            self.cgroup = None


class _HttpError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_body(status: int, message: str, kind: str) -> bytes:
    """An error as llama-server gives it: {"error": {"code", "message", "type"}}."""
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}, separators=(",", ":")).encode()


async def _read_head(reader: asyncio.StreamReader):
    """(method, target, version, headers) of the next request; None where the client closed between requests."""
    try:
        data = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if not e.partial.strip():
            return None
        raise _HttpError(400, "incomplete request head") from None
    except asyncio.LimitOverrunError:
        raise _HttpError(431, "request head too large") from None
    lines = data.decode("latin-1").lstrip("\r\n").split("\r\n")
    start = lines[0].split(" ")
    if len(start) != 3 or not start[2].startswith("HTTP/1."):
        raise _HttpError(400, "malformed request line")
    headers = []
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise _HttpError(400, "malformed header line")
            headers.append((name.strip(), value.strip()))
    return start[0], start[1], start[2], headers


async def _read_body(reader: asyncio.StreamReader, h: dict[str, str]) -> bytes:
    if "chunked" in h.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
                    pass
                return bytes(body)
            body += await reader.readexactly(size)
            await reader.readexactly(2)
            if len(body) > MAX_BODY:
                raise _HttpError(413, f"request body over {MAX_BODY >> 20} MiB")
    try:
        n = int(h.get("content-length") or 0)
    except ValueError:
        raise _HttpError(400, "bad Content-Length") from None
    if n < 0 or n > MAX_BODY:
        raise _HttpError(413, f"request body over {MAX_BODY >> 20} MiB")
    return await reader.readexactly(n)


def _check_body(body: bytes, generating: bool) -> None:
    """A client error is a 400 here, never a 5xx: a body that is not a JSON object, and the fields llama-server lets
    through unchecked (stop, stream_options)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _HttpError(400, f"the request body is not JSON: {e}") from None
    if not generating:
        return
    if not isinstance(data, dict):
        raise _HttpError(400, "the request body must be a JSON object")
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _HttpError(400, "'stop' must be a string or a list of strings")
    options = data.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False),
                                                                                 bool)):
        raise _HttpError(400, "'stream_options' must be an object, its 'include_usage' true or false")


async def _response_head(reader: asyncio.StreamReader) -> tuple[int, list[tuple[str, str]]]:
    data = await reader.readuntil(b"\r\n\r\n")
    lines = data.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = [(n.strip(), v.strip()) for n, _, v in (line.partition(":") for line in lines[1:] if line)]
    return status, headers


async def _response_chunks(reader: asyncio.StreamReader, h: dict[str, str]):
    """The upstream response's body as it comes (chunked, by length, or to the end)."""
    if "chunked" in h.get("transfer-encoding", "").lower():
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)
    elif "content-length" in h:
        left = int(h["content-length"])
        while left > 0:
            part = await reader.read(min(left, 1 << 16))
            if not part:
                raise asyncio.IncompleteReadError(b"", left)
            left -= len(part)
            yield part
    else:
        while part := await reader.read(1 << 16):
            yield part


class _UsageApart:
    """/v1/completions' events as OpenAI streams them: llama-server puts the usage in the last chunk beside its
    choice; OpenAI's usage chunk comes after it, with no choices (what stream_options.include_usage asks for)."""

    def __init__(self):
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        self.pending += data
        *events, self.pending = self.pending.split(b"\n\n")
        return b"".join(self._event(e) + b"\n\n" for e in events)

    @staticmethod
    def _event(event: bytes) -> bytes:
        if not event.startswith(b"data: {") or b'"usage"' not in event:
            return event
        try:
            chunk = json.loads(event[len(b"data: "):])
        except ValueError:
            return event
        if not chunk.get("choices") or "usage" not in chunk:
            return event
        usage = {k: chunk.pop(k) for k in ("usage", "timings") if k in chunk}
        last = {**chunk, "choices": [], **usage}
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\ndata: " + \
            json.dumps(last, separators=(",", ":")).encode()


def _head(version: str, status: int, headers: list[tuple[str, str]]) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [f"{version} {status} {reason}"] + [f"{n}: {v}" for n, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\s+(\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


@dataclass
class _Counts:
    requests: int = 0
    rejected: int = 0
    cancelled: int = 0
    active: int = 0
    waiting: int = 0
    read_base: int = 0  # the child's read_bytes when it was ready (what loading read)
    connections: set = field(default_factory=set)


class Front:
    """The HTTP front (asyncio, HTTP/1.1 with keep-alive) before llama-server's unix socket."""

    def __init__(self, socket_path: str, n_parallel: int, listen: Listen, child: Child, budget: int | None):
        self.socket_path, self.n_parallel, self.listen, self.child, self.budget = (
            socket_path, n_parallel, listen, child, budget)
        self.ready = False
        self.slots = asyncio.Semaphore(n_parallel)
        self.counts = _Counts()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.counts.connections.add(task)
        try:
            while True:
                try:
                    head = await _read_head(reader)
                    if head is None:
                        break
                    keep = await self._request(reader, writer, *head)
                except _HttpError as e:
                    writer.write(_head("HTTP/1.1", e.status, [("Content-Type", "application/json; charset=utf-8"),
                                                              ("Content-Length", str(len(error_body(e.status, e.message,
                                                                                                    e.kind)))),
                                                              ("Connection", "close")]))
                    writer.write(error_body(e.status, e.message, e.kind))
                    await writer.drain()
                    break
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass
        finally:
            self.counts.connections.discard(task)
            writer.close()

    async def _request(self, reader, writer, method: str, target: str, version: str, headers) -> bool:
        h = {n.lower(): v for n, v in headers}
        keep = (h.get("connection", "").lower() != "close") if version == "HTTP/1.1" else (
            h.get("connection", "").lower() == "keep-alive")
        path = target.split("?", 1)[0]
        if h.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        body = await _read_body(reader, h)
        generating = method == "POST" and path in GENERATING
        if not self.ready:
            raise _HttpError(503, "Loading model", "unavailable_error")
        # a browser's CORS preflight carries no key (llama-server answers it without one)
        if self.listen.api_key and path not in PUBLIC and method != "OPTIONS" and not self._authorized(h):
            raise _HttpError(401, "Invalid API Key", "authentication_error")
        if method == "POST" and not h.get("content-type", "").startswith("multipart/"):
            _check_body(body, generating)
        if generating:
            self.counts.requests += 1
            if self.counts.active + self.counts.waiting >= self.n_parallel + self.listen.queue:
                self.counts.rejected += 1
                raise _HttpError(503, f"the queue is full ({self.counts.active} requests generating, "
                                      f"{self.counts.waiting} waiting): try again later", "unavailable_error")
        work = asyncio.ensure_future(self._exchange(writer, method, target, version, headers, body, path, keep,
                                                    generating))
        gone = asyncio.ensure_future(self._client_gone(reader))
        for task in (work, gone):  # an exception no one awaits any more (shutdown) is not an error to log
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # serve is stopping
            work.cancel()
            gone.cancel()
            raise
        if not work.done():  # the client went away: closing the upstream connection cancels its sequence
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            self.counts.cancelled += generating
            return False
        gone.cancel()
        try:
            return work.result() and keep
        except ConnectionError:  # a write to the client failed: it went away mid-answer
            self.counts.cancelled += generating
            return False

    def _authorized(self, h: dict[str, str]) -> bool:
        given = h.get("authorization", "") or h.get("x-api-key", "")
        given = given[len("Bearer "):] if given.startswith("Bearer ") else given
        return hmac.compare_digest(given.encode(), self.listen.api_key.encode())

    @staticmethod
    async def _client_gone(reader: asyncio.StreamReader) -> None:
        while not reader.at_eof():
            await asyncio.sleep(POLL_S)

    async def _exchange(self, writer, method, target, version, headers, body, path, keep, generating) -> bool:
        """Forward one request and its answer; False where the connection must close after it."""
        if generating:
            self.counts.waiting += 1
            try:
                await self.slots.acquire()
            finally:
                self.counts.waiting -= 1
            self.counts.active += 1
        try:
            return await self._forward(writer, method, target, version, headers, body, path, keep)
        finally:
            if generating:
                self.counts.active -= 1
                self.slots.release()

    async def _forward(self, writer, method, target, version, headers, body, path, keep) -> bool:
        try:
            ureader, uwriter = await asyncio.open_unix_connection(self.socket_path, limit=MAX_HEAD)
        except OSError:
            raise _HttpError(503, "the model server is not running", "unavailable_error") from None
        try:
            sent = [(n, v) for n, v in headers if n.lower() not in _HOP]
            sent += [("Host", "localhost"), ("Content-Length", str(len(body))), ("Connection", "close")]
            uwriter.write(f"{method} {target} HTTP/1.1\r\n".encode("latin-1"))
            uwriter.write(("".join(f"{n}: {v}\r\n" for n, v in sent) + "\r\n").encode("latin-1") + body)
            await uwriter.drain()
            status, uheaders = await _response_head(ureader)
            uh = {n.lower(): v for n, v in uheaders}
            back = [(n, v) for n, v in uheaders if n.lower() not in _HOP]
            if not keep:
                back.append(("Connection", "close"))
            streaming = status == 200 and "chunked" in uh.get("transfer-encoding", "").lower()
            if not streaming:
                data = b"".join([part async for part in _response_chunks(ureader, uh)])
                status, data = self._amend(status, data, path)
                writer.write(_head(version, status, back + [("Content-Length", str(len(data)))]) + data)
                await writer.drain()
                return True
            chunked = version == "HTTP/1.1"  # an HTTP/1.0 client reads to the end of the connection
            writer.write(_head(version, status, back + ([("Transfer-Encoding", "chunked")] if chunked else [])))
            events = _UsageApart() if path == "/v1/completions" else None
            async for part in _response_chunks(ureader, uh):
                part = events.feed(part) if events else part
                if part:
                    writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                    await writer.drain()
            if chunked:
                writer.write(b"0\r\n\r\n")
                await writer.drain()
            return chunked
        finally:
            uwriter.close()

    def _amend(self, status: int, data: bytes, path: str) -> tuple[int, bytes]:
        """/metrics with the front's lines; a JSON error llama-server answers with a 500 for the request's own values
        (its parser's exceptions) as the 400 it is."""
        if path == "/metrics" and status == 200:
            return status, data + self.metrics(data.decode("utf-8", "replace")).encode()
        if status == 500:
            with contextlib.suppress(ValueError, AttributeError, TypeError):
                message = json.loads(data)["error"]["message"]
                if "[json.exception." in message:
                    return 400, error_body(400, message, "invalid_request_error")
        return status, data

    def metrics(self, upstream: str) -> str:
        """Prometheus lines beside llama-server's own (tokens, tok/s, requests processing and deferred)."""
        c = self.counts
        read = max(self.child.disk_read_bytes() - c.read_base, 0)
        tokens = _metric(upstream, "llamacpp:tokens_predicted_total")
        passes = _metric(upstream, "llamacpp:n_decode_total")
        now, peak = self.child.memory()
        rows = [
            ("requests_total", "counter", "Generation requests received", c.requests),
            ("requests_rejected_total", "counter", "Generation requests answered 503: the queue was full", c.rejected),
            ("requests_cancelled_total", "counter", "Generation requests whose client went away first", c.cancelled),
            ("requests_active", "gauge", "Generation requests holding a sequence", c.active),
            ("queue_length", "gauge", "Generation requests waiting for a sequence", c.waiting),
            ("queue_capacity", "gauge", "Requests that may wait before a 503", self.listen.queue),
            ("sequences", "gauge", "Sequences the plan serves at once (-np)", self.n_parallel),
            ("disk_read_bytes_total", "counter", "Bytes llama-server read from storage since it was ready", read),
            ("disk_read_bytes_per_token", "gauge", "Bytes read per generated token since ready",
             read / tokens if tokens else 0),
            ("disk_read_bytes_per_pass", "gauge", "Bytes read per llama_decode call since ready",
             read / passes if passes else 0),
            ("memory_bytes", "gauge", "Memory of llama-server now (its cgroup's, page cache included, if enforced)",
             now),
            ("memory_peak_bytes", "gauge", "Peak memory of llama-server (its cgroup's if enforced)", peak),
            ("memory_rss_bytes", "gauge", "llama-server's resident set now (no page cache)", self.child.rss()[0]),
            ("memory_budget_bytes", "gauge", "The budget (--mem; 0: none)", self.budget or 0),
            ("memory_enforced", "gauge", "1 where a memory cgroup holds llama-server to the budget",
             int(self.child.cgroup is not None)),
        ]
        out = []
        for name, kind, text, value in rows:
            out += [f"# HELP flexoffload_{name} {text}", f"# TYPE flexoffload_{name} {kind}",
                    f"flexoffload_{name} {value:g}" if isinstance(value, float) else f"flexoffload_{name} {value}"]
        return "\n".join(out) + "\n"


FOLDER_PREFIX = "flexoffload-serve-"


def _remove_stale_folders() -> None:
    """The temporary folders of serves that were killed (SIGKILL: no cleanup ran), named by their pid."""
    for folder in Path(tempfile.gettempdir()).glob(f"{FOLDER_PREFIX}*-*"):
        pid = folder.name[len(FOLDER_PREFIX):].split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


async def _healthy(socket_path: str) -> bool:
    try:
        reader, writer = await asyncio.open_unix_connection(socket_path)
    except OSError:
        return False
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        await writer.drain()
        status, _ = await _response_head(reader)
        return status == 200
    except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
        return False
    finally:
        writer.close()


@dataclass
class Served:
    """What a serve did, for its last line."""
    requests: int
    cancelled: int
    rejected: int
    peak_mem_mb: float


async def _serve(model: str, settings: Settings, n_parallel: int, listen: Listen, cgroup_limit: int | None,
                 budget: int | None, extra: tuple[str, ...], echo, on_ready) -> Served:
    from flexoffload import native

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
        signals.append(sig)
    _remove_stale_folders()
    tmp = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
    child = front = listener = None
    try:
        socket_path = str(Path(tmp) / "llama.sock")
        cmd = [str(native.tool("llama-server")), *llama_server_args(model, settings, n_parallel, socket_path, extra)]
        front = Front(socket_path, n_parallel, listen, None, budget)
        try:  # bound first: a port in use is an error before the model loads
            listener = await asyncio.start_server(front.connection, list(listen.hosts), listen.port, limit=MAX_HEAD,
                                                  reuse_address=True)
        except OSError as e:
            raise FlexoffloadError(f"cannot listen on {','.join(listen.hosts)}:{listen.port}: {e.strerror}") from None
        port = listener.sockets[0].getsockname()[1]
        if settings.strategy != "mmap":
            raise_memlock_limit()
        child = front.child = Child(cmd, environment(settings), cgroup_limit, settings.verbose)
        t0 = time.perf_counter()
        while not await _healthy(socket_path):
            if child.proc.poll() is not None:
                raise FlexoffloadError(f"llama-server stopped while loading (exit {child.proc.returncode}): "
                                       f"{child.last_error()}")
            if stop.is_set():
                return Served(0, 0, 0, child.memory()[1] / (1 << 20))
            await asyncio.sleep(0.1)
        if settings.strategy != "mmap":  # as the engine does after loading: the page cache reading left
            drop_file_cache(model)
        front.counts.read_base = child.disk_read_bytes()
        front.ready = True
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
        if listener is not None:
            listener.close()
        if front is not None:
            for task in list(front.counts.connections):
                task.cancel()
        if child is not None:
            await loop.run_in_executor(None, child.close)
        shutil.rmtree(tmp, ignore_errors=True)
        for sig in signals:
            loop.remove_signal_handler(sig)


def serve(model: str, settings: Settings, n_parallel: int, listen: Listen, cgroup_limit: int | None = None,
          budget: int | None = None, extra: tuple[str, ...] = (), echo=None, on_ready=None) -> Served:
    """Serve model by settings to n_parallel sequences until SIGINT or SIGTERM, then stop llama-server, remove its
    cgroup and temporary folder. cgroup_limit: llama-server's memory cgroup (None: none); budget: the --mem it
    plans for (reported in /metrics); extra: llama-server's own flags; on_ready(port, load_s) once it answers."""
    return asyncio.run(_serve(model, settings, n_parallel, listen, cgroup_limit, budget, extra, echo, on_ready))
