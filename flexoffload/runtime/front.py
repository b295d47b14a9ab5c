"""`flexoffload serve`'s HTTP front: aiohttp before llama-server's unix socket.

aiohttp parses HTTP/1.1 (keep-alive, chunked bodies, `Expect: 100-continue`, limits on the request line and headers)
and answers a malformed request with a 400 of its own; the front forwards each request to llama-server and its
answer back, server-sent events as each chunk comes. It adds what llama-server lacks (docs/serve.md): a body that
is not JSON is a 400 (llama-server answers 500); at most N requests generate at once and a bounded number wait, 503
beyond; the API key is checked before a request waits; /metrics gains the bytes read from disk per token and per
decode pass, the queue and the memory peak; a client that goes away has its upstream connection closed, which
llama-server takes as a cancellation; until the model answers, every request is llama-server's 503 "Loading model"
(with Retry-After, as a full queue's 503); when serve stops, a waiting or generating request is a 503 (a stream
ends with an error event).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.http import HttpProcessingError

# Requests that take a slot while they run (POST): the ones the queue bounds.
GENERATING = frozenset({
    "/completion", "/completions", "/v1/completions", "/chat/completions", "/v1/chat/completions", "/infill",
    "/responses", "/v1/responses", "/v1/messages", "/embedding", "/embeddings", "/v1/embeddings", "/rerank",
    "/reranking", "/v1/rerank", "/v1/reranking"})
PUBLIC = frozenset({"/health", "/v1/health"})  # answered without the API key, as llama-server does
MAX_BODY = 64 << 20  # bytes of a request body
# llama-server's own limits on a request's head (cpp-httplib: 8 KiB a line, 100 header fields)
MAX_LINE = 8190
MAX_HEADERS = 100
BODY_IDLE_S = 10.0  # a body that stops coming this long is a 408 (it also ends a body aiohttp's parser gave up on)
RETRY_AFTER_S = 1  # a 503 while the model loads or the queue is full says when to try again (Retry-After)
SHUTDOWN_S = 2.0  # time the handlers have to answer once serve stops, before their connections are closed
KEEPALIVE_S = 75.0  # an idle client connection is closed after this

# Headers of one hop: the front's connection to the client and its own to llama-server each have theirs.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "te", "trailer",
                         "upgrade", "proxy-connection", "expect", "host"})


class HttpError(Exception):
    """A request the front answers itself, in llama-server's error shape; close: the connection closes after it (the
    body was not read to its end); retry_after: seconds after which the same request may succeed (a 503 that
    passes: loading, a full queue)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", close: bool = False,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.close = status, message, kind, close
        self.retry_after = retry_after

    def response(self) -> web.Response:
        """The error as an aiohttp response."""
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        response = web.Response(status=self.status, body=error_body(self.status, self.message, self.kind),
                                content_type="application/json", charset="utf-8", headers=headers)
        if self.close:
            response.force_close()
        return response


def error_body(status: int, message: str, kind: str) -> bytes:
    """An error as llama-server gives it: {"error": {"code", "message", "type"}}."""
    return json.dumps({"error": {"code": status, "message": message, "type": kind}}, separators=(",", ":")).encode()


def check_body(body: bytes, generating: bool) -> None:
    """A client error is a 400 here, never a 5xx: a body that is not a JSON object, and the fields llama-server lets
    through unchecked (stop, stream_options)."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HttpError(400, f"the request body is not JSON: {e}") from None
    if not generating:
        return
    if not isinstance(data, dict):
        raise HttpError(400, "the request body must be a JSON object")
    stop = data.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise HttpError(400, "'stop' must be a string or a list of strings")
    options = data.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False),
                                                                                 bool)):
        raise HttpError(400, "'stream_options' must be an object, its 'include_usage' true or false")


class UsageApart:
    """/v1/completions' events as OpenAI streams them: llama-server puts the usage in the last chunk beside its
    choice; OpenAI's usage chunk comes after it, with no choices (what stream_options.include_usage asks for)."""

    def __init__(self):
        self.pending = b""

    def feed(self, data: bytes) -> bytes:
        """The whole events in data and what came before it, rewritten; a partial event waits for its end."""
        self.pending += data
        *events, self.pending = self.pending.split(b"\n\n")
        return b"".join(self.event(e) + b"\n\n" for e in events)

    @staticmethod
    def event(event: bytes) -> bytes:
        """One event: the last chunk split into its choice and the usage, any other as it is."""
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


def metric_value(text: str, name: str) -> float:
    """A Prometheus metric's value in text; 0 where it is absent."""
    m = re.search(rf"^{re.escape(name)}\s+(\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


class ClientFaults(logging.Filter):
    """Drops aiohttp's records of malformed requests (answered 400; the client's fault, each logged with a
    traceback otherwise); a fault of the front itself still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether the record is logged: not where its exception is a malformed request's."""
        return not (record.exc_info and isinstance(record.exc_info[1], HttpProcessingError))


LOG = logging.getLogger(__name__)
LOG.addFilter(ClientFaults())


@dataclass
class Counts:
    """What the front has seen, for /metrics and serve's last line."""
    requests: int = 0
    rejected: int = 0
    cancelled: int = 0
    active: int = 0
    waiting: int = 0
    read_base: int = 0  # the child's read_bytes when it was ready (what loading read)


class Front:
    """The HTTP front before llama-server's unix socket. listen is server.Listen (hosts, port, api_key, queue; not
    imported: server imports this module); child (server.Child: its disk reads and memory, for /metrics) is set once
    llama-server runs; ready once it answers."""

    def __init__(self, socket_path: str, n_parallel: int, listen, budget: int | None):
        self.n_parallel, self.listen, self.budget = n_parallel, listen, budget
        self.child = None
        self.ready = False
        self.stopping = asyncio.Event()
        self.slots = asyncio.Semaphore(n_parallel)
        self.counts = Counts()
        # one connection a request, closed after it: closing it is how llama-server learns a client went away;
        # no timeout (a generation takes as long as it takes) and the body passed on as it is
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket_path, force_close=True, limit=0),
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
        app = web.Application(client_max_size=MAX_BODY)
        app.router.add_route("*", "/{path:.*}", self.handle)
        # handler_cancellation: a client that goes away cancels its handler, which closes its upstream connection
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=LOG,
                                    shutdown_timeout=SHUTDOWN_S, keepalive_timeout=KEEPALIVE_S,
                                    max_line_size=MAX_LINE, max_field_size=MAX_LINE, max_headers=MAX_HEADERS)

    async def open(self) -> int:
        """Listen on every host, all on one port (listen.port, or the one the first host was given for 0); the port.
        OSError where a host cannot be listened on."""
        await self.runner.setup()
        port = self.listen.port
        for host in self.listen.hosts:
            await web.TCPSite(self.runner, host, port, reuse_address=True).start()
            port = self.runner.addresses[0][1]
        return port

    async def close(self) -> None:
        """Stop: no new connection; a waiting request is a 503; every upstream connection closes (llama-server
        cancels those sequences), so a request that was generating is a 503 or its stream ends with an error event;
        then the client connections close."""
        self.stopping.set()
        for site in list(self.runner.sites):
            await site.stop()
        await self.session.close()
        await self.runner.cleanup()

    async def upstream_healthy(self) -> bool:
        """Whether llama-server answers /health with 200 (it has loaded the model)."""
        try:
            async with self.session.get("http://localhost/health", timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One request: the front's own checks, then llama-server's answer."""
        try:
            return await self.answer(request)
        except HttpError as e:
            return e.response()

    async def answer(self, request: web.Request) -> web.StreamResponse:
        """The checks in order: the body's size, loading, the key (before the body is read or a place taken), the
        body, the queue; then the request waits for a sequence and is forwarded."""
        path = request.rel_url.raw_path
        generating = request.method == "POST" and path in GENERATING
        if request.content_length is not None and request.content_length > MAX_BODY:
            raise HttpError(413, f"request body over {MAX_BODY >> 20} MiB", close=True)
        if self.stopping.is_set():
            raise HttpError(503, "the server is stopping", "unavailable_error", close=True)
        if not self.ready:
            raise HttpError(503, "Loading model", "unavailable_error", retry_after=RETRY_AFTER_S)
        # a browser's CORS preflight carries no key (llama-server answers it without one)
        if self.listen.api_key and path not in PUBLIC and request.method != "OPTIONS" and not self.authorized(request):
            raise HttpError(401, "Invalid API Key", "authentication_error")
        body = await self.read_body(request)
        if request.method == "POST" and not request.headers.get("Content-Type", "").startswith("multipart/"):
            check_body(body, generating)
        if not generating:
            return await self.forward(request, body, path, generating)
        c = self.counts
        c.requests += 1
        if c.active + c.waiting >= self.n_parallel + self.listen.queue:
            c.rejected += 1
            raise HttpError(503, f"the queue is full ({c.active} requests generating, {c.waiting} waiting): try "
                                 f"again later", "unavailable_error", retry_after=RETRY_AFTER_S)
        try:
            await self.take_sequence()
        except asyncio.CancelledError:  # the client went away while it waited
            c.cancelled += not self.stopping.is_set()
            raise
        c.active += 1
        try:
            return await self.forward(request, body, path, generating)
        except asyncio.CancelledError:  # the client went away: aiohttp cancelled the handler (handler_cancellation)
            c.cancelled += not self.stopping.is_set()
            raise
        finally:
            c.active -= 1
            self.slots.release()

    def authorized(self, request: web.Request) -> bool:
        """Whether the request carries the API key (Authorization: Bearer KEY, or X-Api-Key as Anthropic's clients
        send it)."""
        given = request.headers.get("Authorization", "") or request.headers.get("X-Api-Key", "")
        given = given[len("Bearer "):] if given.startswith("Bearer ") else given
        return hmac.compare_digest(given.encode(), self.listen.api_key.encode())

    async def read_body(self, request: web.Request) -> bytes:
        """The request's body: 413 over MAX_BODY, 400 where it is malformed, 408 where it stops coming. aiohttp's C
        parser drops a chunked body whose next size line is not hex without a word to the reader (its 400 waits
        behind this request), so that one ends as a body that stopped coming."""
        body = bytearray()
        while True:
            try:
                async with asyncio.timeout(BODY_IDLE_S):
                    part = await request.content.readany()
            except TimeoutError:
                raise HttpError(408, f"the request body stopped coming (nothing for {BODY_IDLE_S:g} s, or a "
                                     f"malformed chunk)", close=True) from None
            except web.RequestPayloadError as e:
                raise HttpError(400, f"malformed request body: {e}", close=True) from None
            if not part:
                return bytes(body)
            body += part
            if len(body) > MAX_BODY:
                raise HttpError(413, f"request body over {MAX_BODY >> 20} MiB", close=True)

    async def take_sequence(self) -> None:
        """Wait in the queue (FIFO) for a sequence; a 503 where serve stops first."""
        self.counts.waiting += 1
        acquire = asyncio.ensure_future(self.slots.acquire())
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait({acquire, stopping}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            acquire.cancel()
            if acquire.done() and not acquire.cancelled():  # taken as the client went: given back
                self.slots.release()
            raise
        finally:
            self.counts.waiting -= 1
            stopping.cancel()
        if not acquire.done():
            acquire.cancel()
            raise HttpError(503, "the server is stopping", "unavailable_error", close=True)

    async def forward(self, request: web.Request, body: bytes, path: str, generating: bool) -> web.StreamResponse:
        """Forward the request to llama-server and its answer back: a 200 stream chunk by chunk, any other answer
        whole (amended: /metrics' lines, a parser's 500 as the 400 it is)."""
        headers = [(n, v) for n, v in request.headers.items() if n.lower() not in HOP_HEADERS]
        try:
            upstream = await self.session.request(request.method, f"http://localhost{request.raw_path}",
                                                  headers=headers, data=body or None, allow_redirects=False)
        except aiohttp.ClientError:
            raise self.upstream_lost(close=False) from None
        try:
            back = [(n, v) for n, v in upstream.headers.items() if n.lower() not in HOP_HEADERS]
            if upstream.status != 200 or upstream.content_length is not None:
                try:
                    data = await upstream.read()
                except aiohttp.ClientError:
                    raise self.upstream_lost(close=False) from None
                status, data = self.amend(upstream.status, data, path)
                return web.Response(status=status, body=data, headers=back)
            return await self.stream(request, upstream, back, path, generating)
        finally:
            upstream.close()  # where it was not read to its end: llama-server sees the connection close

    async def stream(self, request: web.Request, upstream: aiohttp.ClientResponse, back, path: str,
                     generating: bool) -> web.StreamResponse:
        """Server-sent events passed on as each chunk comes (an HTTP/1.0 client reads to the connection's end)."""
        response = web.StreamResponse(status=upstream.status, headers=back)
        events = UsageApart() if path == "/v1/completions" else None
        try:
            await response.prepare(request)
            while True:
                try:
                    part = await upstream.content.readany()
                except aiohttp.ClientError:  # llama-server stopped, or serve did: an error event, then the end
                    lost = self.upstream_lost(close=True)
                    response.force_close()
                    await response.write(b"data: " + error_body(lost.status, lost.message, lost.kind) + b"\n\n")
                    break
                if not part:
                    if events is not None and events.pending:
                        await response.write(events.pending)
                    break
                part = events.feed(part) if events is not None else part
                if part:
                    await response.write(part)
            await response.write_eof()
        except ConnectionError:  # the client went away mid-stream: its upstream connection closes
            self.counts.cancelled += generating and not self.stopping.is_set()
        return response

    def upstream_lost(self, close: bool) -> HttpError:
        """The error for a request whose llama-server connection failed: serve is stopping, or llama-server is not
        (or no longer) running."""
        if self.stopping.is_set():
            return HttpError(503, "the server is stopping", "unavailable_error", close=True)
        return HttpError(503, "the model server is not running", "unavailable_error", close=close)

    def amend(self, status: int, data: bytes, path: str) -> tuple[int, bytes]:
        """/metrics with the front's lines; a JSON error llama-server answers with a 500 for the request's own values
        (its parser's exceptions) as the 400 it is."""
        if path == "/metrics" and status == 200:
            return status, data + self.metrics(data.decode("utf-8", "replace")).encode()
        if status == 500:
            with contextlib.suppress(ValueError, AttributeError, TypeError, KeyError):
                message = json.loads(data)["error"]["message"]
                if "[json.exception." in message:
                    return 400, error_body(400, message, "invalid_request_error")
        return status, data

    def metrics(self, upstream: str) -> str:
        """Prometheus lines beside llama-server's own (tokens, tok/s, requests processing and deferred)."""
        c = self.counts
        read = max(self.child.disk_read_bytes() - c.read_base, 0)
        tokens = metric_value(upstream, "llamacpp:tokens_predicted_total")
        passes = metric_value(upstream, "llamacpp:n_decode_total")
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
