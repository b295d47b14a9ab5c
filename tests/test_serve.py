"""`flexoffload serve` as users use it: the official `openai` client (chat, completion, streaming with usage), errors
(400 for a malformed body or a prompt longer than a sequence's context, 401 without the key, 503 when the queue is
full), concurrent clients (passes shared for certain) whose greedy outputs equal single-client `flexoffload run`
outputs, a client that goes away cancelled, and a clean exit on SIGTERM or SIGINT: no llama-server or process of its
left, no cgroup, no temporary folder. Greedy text is checked against llama-completion (llama.cpp's own CLI) where
serve and run could share a fault: a chat (the conversation laid out in ChatML here), a streamed and enforced
budget, a mixture of experts streamed by expert. Bad input (raw sockets: malformed HTTP a client library would not
send), requests while the model loads, SIGTERM while it loads and SIGTERM with requests in flight each get a clear
status and a closed connection, never a traceback or a hang. Speculation by llama-server's own drafters (n-grams, a
draft model) gives run's greedy text, is planned within the budget, and where it does not fit the server runs
without it.

The models are synthetic (random weights) unless marked integration (the real 0.5B)."""

import contextlib
import http.client
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import cli
from test_equality import llama_completion
from flexoffload import FlexoffloadError
from flexoffload.gguf import catalog, synth

import openai  # noqa: E402  (the official client: a test extra)

# its real model's profiles and streamed runs record the disk: in a cache of the module's own (conftest)
pytestmark = pytest.mark.usefixtures("module_cache")


def left_running(session: int, marker: str | None) -> list[str]:
    """The command lines of live processes (not zombies) in session (llama-server's own: it starts one) or whose
    command line names marker."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (d / "cmdline").read_bytes()
            if fields[0] != "Z" and (int(fields[3]) == session or (marker and marker.encode() in cmdline)):
                found.append(d.name + ": " + cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


class Serving:
    """A `flexoffload serve` process (on a free port unless port is given), its ready line read (unless wait is
    False: then wait_ready); stopped (and checked clean) on exit."""

    def __init__(self, *args: str, timeout: float = 600, port: int = 0, wait: bool = True):
        self.proc = subprocess.Popen([sys.executable, "-m", "flexoffload", "serve", "--port", str(port), "-t", "2",
                                      *args],
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[str] = []
        self.port = port
        self.ready: queue.Queue = queue.Queue()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                if "serving" in line:
                    self.ready.put(line)
            self.ready.put(None)

        threading.Thread(target=read, daemon=True).start()
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:  # a test that fails here never reaches __exit__: no serve is left behind
                self.proc.kill()  # (its llama-server dies with it: setpriv --pdeathsig)
                raise

    def wait_ready(self, timeout: float = 600) -> None:
        """Wait for the ready line: the port it names, llama-server's pid and socket folder."""
        try:
            line = self.ready.get(timeout=timeout)
        except queue.Empty:
            self.proc.kill()
            raise AssertionError(f"serve did not become ready: {''.join(self.lines)}") from None
        if line is None:
            self.proc.wait()
            raise AssertionError(f"serve exited ({self.proc.returncode}): {''.join(self.lines)}")
        self.port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
        self.base = f"http://127.0.0.1:{self.port}"
        self.server_pid = self.llama_server()
        assert self.server_pid is not None, f"no llama-server child of {self.proc.pid}"

    def llama_server(self) -> int | None:
        """The pid of serve's llama-server child (its socket's folder in socket_dir); None before it starts."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        for pid in children:
            with contextlib.suppress(OSError):
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if any(b"llama-server" in part for part in cmd) and b"--host" in cmd:
                    self.socket_dir = Path(cmd[cmd.index(b"--host") + 1].decode()).parent
                    return int(pid)
        return None

    def client(self, key: str = "none", **kw):
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, **kw)

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = 120, with_headers: bool = False):
        """(status, parsed body or text) of a plain HTTP request; and its response's headers if with_headers."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            data = r.read().decode()
            with contextlib.suppress(ValueError):
                data = json.loads(data)
            return (r.status, data, r.headers) if with_headers else (r.status, data)
        finally:
            conn.close()

    def metric(self, name: str, key: str | None = None) -> float:
        _, text = self.request("GET", "/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise AssertionError(f"{name} not in /metrics")

    def stop(self, sig=signal.SIGTERM) -> str:
        """Stop it as a service manager (SIGTERM) or a terminal (SIGINT) does; check that nothing is left."""
        cgroups = [p for p in Path("/sys/fs/cgroup").rglob(f"flexoffload-{self.proc.pid}-*")] \
            if Path("/sys/fs/cgroup").is_dir() else []
        server_pid = getattr(self, "server_pid", None) or self.llama_server()  # before ready: maybe none yet
        self.proc.send_signal(sig)
        assert self.proc.wait(timeout=30) == 0, "".join(self.lines)
        time.sleep(0.2)  # the reader thread's last lines
        assert server_pid is None or not Path(f"/proc/{server_pid}").exists() or \
            Path(f"/proc/{server_pid}/stat").read_text().split()[2] == "Z", "llama-server outlived serve"
        if server_pid is not None:  # nor any process it started, nor one still naming its socket's folder
            left = left_running(server_pid, str(getattr(self, "socket_dir", "")) or None)
            assert not left, f"left running after serve: {left}"
        assert not hasattr(self, "socket_dir") or not self.socket_dir.exists(), f"{self.socket_dir} left behind"
        assert not any(p.exists() for p in cgroups), f"cgroups left behind: {cgroups}"
        return "".join(self.lines)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.stop()


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory) -> Path:
    """A synthetic model in K-quants (llama-quantize Q4_K_M of a Q4_0 one) whose greedy choices are often near ties:
    a change of rounding shows in its text. K-quants, unlike Q4_0, are computed row by row at any batch size once
    the tiled kernels are off (GGML_CPU_TILED_MM=0): the same rounding however many sequences share a pass."""
    from flexoffload import native

    folder = tmp_path_factory.mktemp("models")
    shape = synth.Shape(n_layer=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=2048)
    source = synth.write(folder / "q4_0.gguf", shape)
    target = folder / "kquant.gguf"
    subprocess.run([str(native.tool("llama-quantize")), "--allow-requantize", str(source), str(target), "Q4_K_M"],
                   check=True, capture_output=True, timeout=300)
    return target


@pytest.fixture(scope="module")
def slow_model(tmp_path_factory) -> Path:
    """A synthetic model slow enough (about 10 ms a token: 900 take seconds) that a long request is still running when
    a test looks at it, and after llama-server's once-a-second look at its client's connection."""
    shape = synth.Shape(n_layer=6, n_embd=2048, n_ff=5632, n_head=16, n_head_kv=4, n_vocab=384, n_ctx_train=2048)
    return synth.write(tmp_path_factory.mktemp("models") / "slow.gguf", shape)


def run_text(model, prompt, n, *extra) -> str:
    r = cli("run", "-m", str(model), "-p", prompt, "-n", str(n), "--temp", "0", "-t", "2", "--json", *extra,
            check=True)
    return json.loads(r.stdout)["text"]


# a conversation whose every turn shows in the tiny model's greedy text (most of its answers are " vb vb ...")
CONVERSATION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x y"},
                {"role": "assistant", "content": "z w v"}, {"role": "user", "content": "q r"}]


def chatml(messages: list[dict]) -> str:
    """The conversation as ChatML lays it out (llama.cpp's template for a model that has none), the assistant's
    turn opened."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + \
        "<|im_start|>assistant\n"


def test_completion_chat_and_stream_with_the_openai_client(tiny_model):
    with Serving("-m", str(tiny_model), "-c", "512", "-np", "2") as s:
        client = s.client()
        models = client.models.list()
        assert [m.id for m in models.data] == [tiny_model.stem]

        done = client.completions.create(model=tiny_model.stem, prompt="a b c d", max_tokens=8, temperature=0)
        assert done.choices[0].text == run_text(tiny_model, "a b c d", 8, "-c", "512")
        assert done.usage.completion_tokens == 8 and done.usage.prompt_tokens == 5
        assert done.choices[0].finish_reason == "length"

        # a chat: greedy text equal to llama-completion's on the conversation in ChatML, written here (the template
        # llama.cpp falls back to for a model without one); a turn dropped would show
        chat = client.chat.completions.create(model="any", messages=CONVERSATION, max_tokens=8, temperature=0, seed=1,
                                              top_p=0.9)
        answer = chat.choices[0].message.content
        assert chat.choices[0].message.role == "assistant"
        assert answer == llama_completion(tiny_model, chatml(CONVERSATION), 8, ctx=512)
        assert chat.usage.completion_tokens == 8
        for role in ("system", "assistant"):
            assert answer != llama_completion(tiny_model, chatml([m for m in CONVERSATION if m["role"] != role]), 8,
                                              ctx=512), f"the {role} turn does not change the answer"

        # streamed: the same text in pieces, then a last chunk with no choices and the usage
        chunks = list(client.completions.create(model="any", prompt="a b c d", max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
        chat_chunks = list(client.chat.completions.create(
            model="any", messages=CONVERSATION, max_tokens=8, temperature=0, seed=1, top_p=0.9, stream=True,
            stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices) == answer
        assert chat_chunks[-1].usage.completion_tokens == 8

        # the wire: server-sent events ending in data: [DONE]
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 3, "stream": True}))
        r = conn.getresponse()
        events = [e for e in r.read().decode().split("\n\n") if e.strip()]
        assert r.status == 200 and r.getheader("Content-Type").startswith("text/event-stream")
        assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)

        # a stop string ends the text before it
        stopped = client.completions.create(model="any", prompt="a b c d", max_tokens=8, temperature=0,
                                            stop=[done.choices[0].text[3:7]])
        assert done.choices[0].text.startswith(stopped.choices[0].text)
        assert len(stopped.choices[0].text) < len(done.choices[0].text)
        s.stop()


def test_errors_are_llama_servers_shape_and_never_5xx_for_a_client_error(tiny_model):
    with Serving("-m", str(tiny_model), "-c", "512", "-np", "2") as s:
        for body in (b"not json", b"{\"prompt\": ", b"\xff\xfe"):
            status, answer = s.request("POST", "/v1/completions", body)
            assert status == 400 and answer["error"]["code"] == 400, answer
            assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["message"]
        for fields in ({"max_tokens": "many"}, {"temperature": "hot"}, {"stop": 5},
                       {"stream": True, "stream_options": 5}, {"max_tokens": -5}):
            status, answer = s.request("POST", "/v1/completions", json.dumps({"prompt": "a", **fields}).encode())
            assert status == 400 and answer["error"]["type"] == "invalid_request_error", (fields, answer)
        status, answer = s.request("POST", "/v1/chat/completions", json.dumps({"messages": 5}).encode())
        assert status == 400

        # longer than a sequence's share of the context (512 / 2): 400, naming both lengths
        long_prompt = " ".join(["a"] * 300)
        with pytest.raises(openai.BadRequestError) as e:
            s.client().completions.create(model="any", prompt=long_prompt, max_tokens=4)
        assert e.value.status_code == 400
        assert "(301 tokens)" in str(e.value) and "(256 tokens)" in str(e.value)

        status, answer = s.request("GET", "/v1/nothing")
        assert status == 404 and answer["error"]["code"] == 404
        s.stop()


def test_api_key(tiny_model):
    with Serving("-m", str(tiny_model), "-c", "256", "-np", "1", "--api-key", "sesame") as s:
        assert s.request("GET", "/health")[0] == 200  # the one endpoint open without the key
        for path in ("/v1/models", "/metrics", "/props"):
            status, answer = s.request("GET", path)
            assert status == 401 and answer["error"]["type"] == "authentication_error", path
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").completions.create(model="any", prompt="a", max_tokens=2)
        assert s.client("sesame").completions.create(model="any", prompt="a", max_tokens=2).usage.completion_tokens
        assert s.metric("flexoffload_requests_total", key="sesame") == 1  # a refused request took no place
        s.stop()


def waiting_connections(socket_path: Path) -> int:
    """Connections waiting to be accepted on the listening unix socket at socket_path (ss: its Recv-Q)."""
    listed = subprocess.run(["ss", "-xlnH"], capture_output=True, text=True, check=True).stdout
    for line in listed.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == str(socket_path):
            return int(fields[2])
    return 0


def test_concurrent_clients_get_single_client_greedy_outputs(kquant_model, monkeypatch):
    """Twelve requests from eight clients on four sequences (the rest wait in the queue), prompts of 1 to 19 tokens:
    each text is the one `flexoffload run` gives for its prompt alone, whatever shared its passes.

    That passes are shared is made certain, not left to timing: llama-server is held stopped (SIGSTOP) until four
    requests wait on its socket (the other four clients in the front's queue), so the four start together; its own
    counts then say so (more than one busy sequence a decode pass on average, passes saved).
    Kernels row by row on both sides (K-quants, GGML_CPU_TILED_MM=0; docs/serve.md says why), so any difference is
    the serving's: a sequence seeing another's cells, a prompt cached for the wrong slot, a token sampled for the
    wrong request."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    prompts = ["a b c d e f g h i j", "x", "q r s", "d c b a a b c d e f g h i j k l m n", "z y x w v", "m n o p"]
    alone = {p: run_text(kquant_model, p, 32, "-c", "1024") for p in prompts}
    assert len(set(alone.values())) >= 3  # the prompt matters
    with Serving("-m", str(kquant_model), "-c", "1024", "-np", "4") as s:
        client = s.client()

        def ask(i):
            p = prompts[i % len(prompts)]
            return p, client.completions.create(model="any", prompt=p, max_tokens=32, temperature=0).choices[0].text

        os.kill(s.server_pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(8) as pool:
                answers = [pool.submit(ask, i) for i in range(12)]
                deadline = time.time() + 60
                while waiting_connections(s.socket_dir / "llama.sock") < 4:
                    assert time.time() < deadline, "four requests did not reach llama-server"
                    time.sleep(0.02)
                assert waiting_connections(s.socket_dir / "llama.sock") == 4  # one a sequence, the rest queued
                os.kill(s.server_pid, signal.SIGCONT)
                answers = [a.result(timeout=300) for a in answers]
        finally:
            os.kill(s.server_pid, signal.SIGCONT)
        assert [t for _, t in answers] == [alone[p] for p, _ in answers]
        assert s.metric("flexoffload_requests_total") == 12
        assert s.metric("llamacpp:tokens_predicted_total") == 12 * 32
        # passes were shared: a request alone takes 32 passes (its prompt's, then 31), so one by one 12 take 384
        # with one busy sequence each; the four held together share theirs, and the eight after them may come one
        # by one as the front hands them over (then 32 + 8 * 32 passes, 4/3 busy a pass: seen), or together
        assert s.metric("llamacpp:n_busy_slots_per_decode") > 1.2
        assert s.metric("llamacpp:n_decode_total") <= 12 * 32 - 2 * 32
        s.stop()


@pytest.fixture(scope="module")
def varied_model(tmp_path_factory) -> Path:
    """A synthetic model whose greedy text varies with the prompt and along it (deeper or wider synthetic models
    settle on one token: a fault would hardly show in their text), with a 32768-token vocabulary: its embeddings and
    output, 9 of its 10 MiB, stream at a budget."""
    shape = synth.Shape(n_layer=3, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=32768, n_ctx_train=2048)
    return synth.write(tmp_path_factory.mktemp("models") / "varied.gguf", shape)


def minimum_mib(model: Path, *flags: str) -> int:
    """The least budget serve takes for model with flags, in MiB (read from its refusal of 1 MiB)."""
    r = cli("serve", "-m", str(model), "--port", "0", *flags, "--mem", "1M")
    assert r.returncode != 0 and "the minimum is" in r.stderr, r.stderr
    return int(r.stderr.split("the minimum is ")[1].split()[0])


def test_np_is_capped_where_the_budget_holds_fewer_sequences(tmp_path):
    """-np 8 at a budget between one sequence's minimum and eight's: served with as many as fit, said on stderr
    (a pass's logits rows of a 256k vocabulary, one a sequence, are what grows here)."""
    path = synth.write(tmp_path / "wide.gguf", synth.SHAPES["gemma3-tiny-256k"])
    flags = ("-c", "256", "-b", "32", "--spec-type", "none")
    one, eight = minimum_mib(path, *flags, "-np", "1"), minimum_mib(path, *flags, "-np", "8")
    assert eight > one
    with Serving("-m", str(path), *flags, "-np", "8", "--mem", f"{(one + eight) // 2}M") as s:
        said = "".join(s.lines)
        capped = int(said.split("-np capped at ")[1].split(":")[0])
        assert 1 <= capped < 8 and f"({capped} sequences of" in said
        with s.client() as c:
            assert c.completions.create(model="x", prompt="a b", max_tokens=4, temperature=0).choices[0].text


def test_streamed_and_budgeted_run_in_a_cgroup(varied_model):
    """--mem with --enforce at the least budget: llama-server streams by the plan's -ot lines in a memory cgroup at
    the budget; each greedy text is llama-completion's on the same file, in memory (llama.cpp's own path, not run's:
    a fault of the streaming or the plan that run shares would show); /metrics reports the budget, the cgroup's peak
    and the queue."""
    flags = ["-c", "256", "-np", "2", "--strategy", "prefetch"]
    budget = minimum_mib(varied_model, *flags)
    with Serving("-m", str(varied_model), *flags, "--mem", f"{budget}M", "--enforce") as s:
        assert "enforced" in "".join(s.lines) and "prefetch" in "".join(s.lines)
        cmd = Path(f"/proc/{s.server_pid}/cmdline").read_bytes().split(b"\0")
        assert b"^output\\.weight$=STREAMED" in cmd  # the largest tensor
        assert cmd[cmd.index(b"-lm") + 1] == b"mlock"
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{s.server_pid}/environ").read_bytes().split(b"\0") if kv)
        assert env[b"LLAMA_STREAM_WINDOW"] == b"3" and env[b"GGML_CPU_SPLIT_KV"] == b"0"
        texts = {}
        for prompt in ("a b c d", "m n o p"):
            texts[prompt] = s.client().completions.create(model="any", prompt=prompt, max_tokens=16,
                                                          temperature=0).choices[0].text
            assert texts[prompt] == llama_completion(varied_model, prompt, 16, ctx=256), prompt
        assert len(set(texts.values())) == 2 and all(len(set(t.split())) > 1 for t in texts.values())
        assert s.metric("flexoffload_memory_enforced") == 1
        assert s.metric("flexoffload_memory_budget_bytes") == budget << 20
        assert 0 < s.metric("flexoffload_memory_peak_bytes") <= budget << 20
        assert s.metric("flexoffload_disk_read_bytes_per_pass") > 1 << 20  # each pass reads the streamed weights
        assert s.metric("flexoffload_queue_capacity") == 32 and s.metric("flexoffload_sequences") == 2
        assert s.metric("llamacpp:tokens_predicted_total") == 2 * 16
        s.stop(signal.SIGINT)


def test_queue_full_is_503_and_a_client_that_goes_away_is_cancelled(slow_model):
    with Serving("-m", str(slow_model), "-c", "1024", "-np", "1", "--queue", "0") as s:
        # a streamed request holds the one sequence: a second one has no place to wait
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "a b c", "max_tokens": 900, "stream": True, "temperature": 0}))
        r = conn.getresponse()
        assert r.status == 200 and r.readline().startswith(b"data: ")
        status, answer, headers = s.request("POST", "/v1/completions",
                                            json.dumps({"prompt": "a", "max_tokens": 2}).encode(), with_headers=True)
        assert status == 503 and answer["error"]["type"] == "unavailable_error"
        assert "queue" in answer["error"]["message"]
        assert int(headers.get("Retry-After") or 0) > 0, dict(headers)  # when to try again
        assert s.metric("flexoffload_requests_rejected_total") == 1
        assert s.metric("llamacpp:requests_processing") == 1

        # the client goes away mid-stream: its sequence is cancelled long before its 900 tokens
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.time() + 30
        while s.metric("llamacpp:requests_processing") != 0:
            assert time.time() < deadline, "the stream's sequence was not cancelled"
            time.sleep(0.1)
        assert s.metric("llamacpp:tokens_predicted_total") < 900
        assert s.metric("flexoffload_requests_cancelled_total") == 1

        # and the sequence serves the next request
        assert s.client().completions.create(model="any", prompt="a", max_tokens=3).usage.completion_tokens == 3
        s.stop()


def test_a_client_of_a_request_not_streamed_that_goes_away_is_cancelled(slow_model):
    """llama-server looks at the connection of a request that is not streamed once a second: its sequence stops then,
    even while other requests (here /metrics, ten times a second) keep it busy (patch 0020: before it, never)."""
    with Serving("-m", str(slow_model), "-c", "1024", "-np", "1") as s:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": "b c d", "max_tokens": 900, "temperature": 0}))
        deadline = time.time() + 30
        while s.metric("llamacpp:requests_processing") != 1:
            assert time.time() < deadline, "the request did not start"
            time.sleep(0.05)
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        deadline = time.time() + 30
        while s.metric("flexoffload_requests_cancelled_total") != 1 or s.metric("llamacpp:requests_processing"):
            assert time.time() < deadline, f"the request's sequence was not cancelled: {s.request('GET', '/metrics')}"
            time.sleep(0.1)
        assert s.metric("llamacpp:tokens_predicted_total") < 900
        s.stop()


def raw_http(port: int, *parts: bytes, pause: float = 0.3, timeout: float = 60,
             close_wait: float = 0.0) -> tuple[int | None, bytes, bool]:
    """(status or None, whole answer, closed) of bytes sent as they are on a fresh connection (parts pause seconds
    apart), read until the answer is whole (its Content-Length) or the server closes the connection; closed: whether
    the server closed it (waited for close_wait seconds after a whole answer). A client library would refuse to send
    most of what these tests send."""
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        for i, part in enumerate(parts):
            if i:
                time.sleep(pause)
            sock.sendall(part)
        answer = b""
        try:
            while chunk := sock.recv(1 << 16):
                answer += chunk
                head, sep, body = answer.partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n")[1:]
                          if line.lower().startswith(b"content-length:")]
                if sep and length and len(body) >= length[0]:
                    break
            else:
                closed = True
            if not closed and close_wait:
                sock.settimeout(close_wait)
                with contextlib.suppress(TimeoutError):
                    closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
    status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.") else None
    return (int(status) if status else None), answer, closed


def test_malformed_http_is_a_clear_status_never_a_traceback(tiny_model):
    """What a client library would not send: each is answered with a status and the connection closed, nothing
    reaches llama-server, serve logs no traceback and goes on serving."""
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
    body = json.dumps({"prompt": "a", "max_tokens": 2}).encode()
    with Serving("-m", str(tiny_model), "-c", "256", "-np", "1") as s:
        cases = {  # what -> (parts sent, the statuses that say it)
            "a chunk size line that is not hex": (
                [post + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n"], {400}),
            "a size line that is not hex after a good chunk": (
                [post + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n", b"1x;\r\n}\r\n0\r\n\r\n"], {400, 408}),
            "a Content-Length that is not a number": ([post + b"Content-Length: abc\r\n\r\n" + body], {400}),
            "a negative Content-Length": ([post + b"Content-Length: -5\r\n\r\n" + body], {400}),
            "a Content-Length beyond any integer": (
                [post + b"Content-Length: 99999999999999999999999999\r\n\r\n" + body], {400, 413}),
            "a Content-Length over the body limit (64 MiB), its body never sent": (
                [post + b"Content-Length: 67108865\r\n\r\n" + body], {413}),
            "a header over the limit": ([post + b"X-Big: " + b"a" * 100_000 + b"\r\n\r\n"], {400, 431}),
            "a header block of many headers": (
                [post + b"".join(b"X-%d: %s\r\n" % (i, b"a" * 600) for i in range(200)) + b"\r\n"], {400, 431}),
            "a request line that is not HTTP": ([b"HELLO THERE\r\n\r\n"], {400}),
            "both a Content-Length and chunked": (
                [post + b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"], {400}),
            "two Content-Lengths that differ": ([post + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{} "], {400}),
        }
        for what, (parts, statuses) in cases.items():
            t0 = time.time()
            # the connection closed after the answer: at once, or (a body not read to its end) once aiohttp has
            # read what more comes for its lingering time (10 s)
            status, answer, closed = raw_http(s.port, *parts, close_wait=15 if statuses & {408, 413} else 5)
            assert status in statuses, (what, answer[:300])
            assert time.time() - t0 < 45, what  # answered and closed, not left to a client's timeout
            assert b"Traceback" not in answer, what
            assert closed, (what, answer[:300])
        # a body cut short by a client that goes away: nothing to answer, nothing logged
        with socket.create_connection(("127.0.0.1", s.port)) as sock:
            sock.sendall(post + b"Content-Length: 100\r\n\r\n{\"prompt\"")
        assert s.request("GET", "/health")[0] == 200
        assert s.client().completions.create(model="any", prompt="a", max_tokens=2).usage.completion_tokens == 2
        assert s.metric("flexoffload_requests_total") == 1  # none of the malformed ones counted as a request
        assert s.metric("flexoffload_requests_active") == 0 and s.metric("flexoffload_queue_length") == 0
        assert s.metric("llamacpp:requests_processing") == 0
        lines = s.stop()
    assert "Traceback" not in lines and "Error handling request" not in lines, lines


def test_several_hosts_on_one_port(tiny_model):
    """--host A,B with --port 0: every host listens on the one port the ready line names (and ::1 too where this
    machine has IPv6 loopback)."""
    hosts = ["127.0.0.1", "127.0.0.2"]
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        hosts.append("::1")
    with Serving("-m", str(tiny_model), "-c", "256", "-np", "1", "--host", ",".join(hosts)) as s:
        for host in hosts:
            conn = http.client.HTTPConnection(host, s.port, timeout=30)
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "a", "max_tokens": 2}))
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2, host
            conn.close()
        s.stop()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def loading_server(s: Serving, bound: bool) -> int:
    """llama-server's pid, held stopped (SIGSTOP) before it has loaded the model: as soon as it starts, or once it
    listens on its socket (bound: it then owes the front's health check an answer it cannot give)."""
    deadline = time.time() + 120
    while (pid := s.llama_server()) is None or (bound and not (s.socket_dir / "llama.sock").exists()):
        assert s.proc.poll() is None and time.time() < deadline, "".join(s.lines)
        time.sleep(0.002)
    os.kill(pid, signal.SIGSTOP)
    assert not any("serving" in line for line in s.lines), "llama-server loaded before the test stopped it"
    return pid


def test_requests_while_the_model_loads_are_503_loading(slow_model):
    """The front listens before llama-server has loaded the model: until it has, every request (health, generation,
    a body that is not even JSON) is at once llama-server's own 503 "Loading model", with a Retry-After. llama-server
    is held stopped (SIGSTOP) while it loads, so the test does not race the load."""
    s = Serving("-m", str(slow_model), "-c", "256", "-np", "1", port=free_port(), wait=False)
    with s:
        pid = loading_server(s, bound=False)
        try:
            for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                       ("POST", "/v1/completions", json.dumps({"prompt": "a"}).encode()),
                                       ("POST", "/v1/chat/completions", b"not json")):
                t0 = time.time()
                status, answer, headers = s.request(method, path, body, timeout=30, with_headers=True)
                assert status == 503 and answer["error"] == {"code": 503, "message": "Loading model",
                                                             "type": "unavailable_error"}, (path, answer)
                assert int(headers.get("Retry-After") or 0) > 0 and time.time() - t0 < 5, (path, dict(headers))
        finally:
            os.kill(pid, signal.SIGCONT)
        s.wait_ready()
        assert s.request("GET", "/health")[0] == 200
        assert s.client().completions.create(model="any", prompt="a", max_tokens=2).usage.completion_tokens == 2
        s.stop()


@pytest.mark.parametrize("bound", [False, True], ids=["starting", "listening"])
def test_sigterm_while_the_model_loads(slow_model, bound):
    """SIGTERM before llama-server has loaded the model (held stopped as it starts, or once it listens and owes the
    front an answer to its health check): serve exits 0 within seconds, not after the check's timeout, and leaves
    no llama-server, process of its, folder or cgroup behind (Serving.stop); a request meanwhile is a 503."""
    s = Serving("-m", str(slow_model), "-c", "256", "-np", "1", "--mem", "200M", "--enforce", port=free_port(),
                wait=False)
    with s:
        s.server_pid = loading_server(s, bound)
        assert s.request("GET", "/v1/models", timeout=30)[0] == 503
        t0 = time.time()
        lines = s.stop()
        assert time.time() - t0 < 8, lines  # llama-server's SIGTERM is pending while it is stopped: 3 s, then SIGKILL
    assert "Traceback" not in lines and "stopped after 0 requests" in lines, lines


def test_sigterm_with_requests_in_flight(slow_model):
    """SIGTERM while one request streams, one waits in the queue not streamed and one streamed, one has sent half its
    body and one connection is idle between requests: each gets a clear answer at once (the waiting ones a 503, the
    stream its end, cut before [DONE]; the half-sent and the idle connections are closed), serve exits 0 and leaves
    no llama-server, process of its, folder or cgroup behind (Serving.stop). On the way: a request without the key
    is a 401 while the queue is full, not a 503 and not a place in it (the key is checked before a request waits)."""
    with Serving("-m", str(slow_model), "-c", "1024", "-np", "1", "--queue", "2", "--api-key", "k") as s:
        key = {"Authorization": "Bearer k"}
        half = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\"")
        idle = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert idle.recv(1 << 16).startswith(b"HTTP/1.1 200")
        streaming = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        streaming.request("POST", "/v1/completions", headers=key, body=json.dumps(
            {"prompt": "a b c", "max_tokens": 900, "stream": True, "temperature": 0}))
        stream = streaming.getresponse()
        assert stream.status == 200 and stream.readline().startswith(b"data: ")

        def waiting(streamed: bool):
            """(status, text) of a request that waits for the one sequence; (None, why) where it was cut."""
            conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
            try:
                conn.request("POST", "/v1/completions", headers=key, body=json.dumps(
                    {"prompt": "x", "max_tokens": 900, "stream": streamed}))
                r = conn.getresponse()
                return r.status, r.read().decode()
            except (ConnectionError, http.client.HTTPException) as e:
                return None, repr(e)
            finally:
                conn.close()

        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(waiting, False), pool.submit(waiting, True)]
            deadline = time.time() + 30
            while s.metric("flexoffload_queue_length", key="k") != 2:
                assert time.time() < deadline, "the two requests did not queue"
                time.sleep(0.05)
            status, answer = s.request("POST", "/v1/completions", json.dumps({"prompt": "a"}).encode())
            assert status == 401 and answer["error"]["type"] == "authentication_error"
            assert s.metric("flexoffload_requests_total", key="k") == 3

            t0 = time.time()
            s.proc.send_signal(signal.SIGTERM)
            for future in answers:
                status, text = future.result(timeout=30)
                assert status == 503 and json.loads(text)["error"]["type"] == "unavailable_error", (status, text)
        rest = b""
        with contextlib.suppress(ConnectionError, http.client.HTTPException):
            rest = stream.read()
        assert b"[DONE]" not in rest  # cut: not a stream that looks complete
        for sock in (half, idle):
            with sock, contextlib.suppress(ConnectionResetError):
                answer = b""
                while chunk := sock.recv(1 << 16):  # to its close (a timeout fails the test)
                    answer += chunk
                assert answer == b"" or answer.startswith(b"HTTP/1.1 503"), answer
        assert time.time() - t0 < 15
        lines = s.stop()
    assert "Traceback" not in lines, lines


def test_refusals_before_anything_starts(tiny_model):
    r = cli("serve", "-m", str(tiny_model), "--port", "0", "--", "-c", "64")
    assert r.returncode != 0 and "serve's own" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", "-m", str(tiny_model), "--port", "0", "-c", "64", "-np", "8")
    assert r.returncode != 0 and "at least 16 cells" in r.stderr
    r = cli("serve", "-m", str(tiny_model), "--port", "0", "--mem", "1M")
    assert r.returncode != 0 and "too small" in r.stderr and "Traceback" not in r.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = cli("serve", "-m", str(tiny_model), "--port", str(taken.getsockname()[1]))
    assert r.returncode != 0 and "cannot listen" in r.stderr


def test_llama_server_flags_from_the_runs_settings():
    """The engine's settings as llama-server's flags: the plan's overrides each an -ot, the streaming runtime's
    settings in the environment, -c shared by the sequences."""
    from flexoffload.runtime import server
    from flexoffload.runtime.engine import Settings

    settings = Settings(n_ctx=4096, n_batch=256, n_threads=3, strategy="stream", window=2, io_threads=5,
                        expert_slots=4, streamed_patterns=(r"^blk\.\d+\.ffn_up\.weight$", r"^output\.weight$"))
    args = server.llama_server_args("/m/model.gguf", settings, 4, "/tmp/x/llama.sock", ("--jinja",))
    pairs = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("-") and not args[i + 1].startswith("-")}
    assert pairs["-c"] == "4096" and pairs["-np"] == "4" and "-no-kvu" in args  # each sequence its own 1024 cells
    assert pairs["-b"] == "256" and pairs["-ub"] == "256" and pairs["-t"] == "3" and pairs["-lm"] == "mlock"
    assert [args[i + 1] for i, a in enumerate(args) if a == "-ot"] == [
        r"^blk\.\d+\.ffn_up\.weight$=STREAMED", r"^output\.weight$=STREAMED"]
    assert args[-1] == "--jinja" and "--no-repack" in args and pairs["--host"] == "/tmp/x/llama.sock"
    assert server.environment(settings) == {"LLAMA_STREAM_WINDOW": "2", "LLAMA_STREAM_IO_THREADS": "5",
                                            "LLAMA_STREAM_CHUNK_BYTES": str(settings.chunk_bytes),
                                            "LLAMA_STREAM_EXPERT_SLOTS": "4", "LLAMA_STREAM_EXPERT_POLICY": "lru",
                                            "LLAMA_STREAM_EXPERT_WHOLE": "0", "LLAMA_STREAM_EXPERT_AHEAD": "0",
                                            "LLAMA_STREAM_EXPERT_LOOKAHEAD": "0", "LLAMA_STREAM_EXPERT_ROUTER": "1",
                                            "GGML_CPU_TILED_MM": "0"}
    # a plan that streams a MoE's expert tensors whole (patch 0021), or keeps its experts by frequency, or reads the
    # next layer's predicted experts ahead (0029)
    assert server.environment(replace(settings, expert_whole=True))["LLAMA_STREAM_EXPERT_WHOLE"] == "1"
    assert server.environment(replace(settings, expert_lookahead=True))["LLAMA_STREAM_EXPERT_LOOKAHEAD"] == "1"
    assert server.environment(replace(settings, expert_policy="lfu"))["LLAMA_STREAM_EXPERT_POLICY"] == "lfu"
    mmap = server.llama_server_args("/m/model.gguf", Settings(strategy="mmap"), 1, "/s.sock")
    assert "-ot" not in mmap and mmap[mmap.index("-lm") + 1] == "mmap"
    # row-by-row kernels unless --tiled (llama.cpp's own kernels: nothing set)
    assert server.environment(Settings()) == {"GGML_CPU_TILED_MM": "0"}
    assert server.environment(Settings(), tiled=True) == {}


def test_llama_server_flags_of_speculation():
    """Speculation as llama-server's own flags: the draft on this machine, whole (-ngld 0, -devd none: the target's -ot
    lines are not the draft's), its KV types the target's, --spec-type always given (-md alone drafts nothing), the
    n-gram drafters' keys and lengths; the row-by-row kernels in the environment; the flags serve plans for are its
    own after `--`."""
    from flexoffload.runtime import server
    from flexoffload.runtime.engine import Settings

    settings = Settings(n_ctx=1024, strategy="stream", type_k="q8_0", type_v="q8_0")
    draft = server.Speculation("/m/draft.gguf", ("draft-simple",), n_max=5)
    args = server.llama_server_args("/m/model.gguf", settings, 2, "/s.sock", (), draft)
    pairs = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("-")}
    assert pairs["-md"] == "/m/draft.gguf" and pairs["--spec-type"] == "draft-simple"
    assert pairs["--spec-draft-n-max"] == "5" and pairs["-ngld"] == "0" and pairs["-devd"] == "none"
    assert pairs["-ctkd"] == "q8_0" and pairs["-ctvd"] == "q8_0" and "--spec-ngram-simple-size-m" not in args
    assert draft.rows == 6 and "draft.gguf drafts 5" in draft.describe()
    ngrams = server.Speculation(None, ("ngram-simple", "ngram-map-k"), ngram_max=12)
    args = server.llama_server_args("/m/model.gguf", settings, 2, "/s.sock", (), ngrams)
    pairs = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("-")}
    assert "-md" not in args and pairs["--spec-type"] == "ngram-simple,ngram-map-k"
    assert pairs["--spec-ngram-simple-size-n"] == "3" and pairs["--spec-ngram-simple-size-m"] == "12"
    assert pairs["--spec-ngram-map-k-size-n"] == "4" and pairs["--spec-ngram-map-k-size-m"] == "12"
    assert ngrams.rows == 13
    assert server.environment(settings, ngrams)["GGML_CPU_TILED_MM"] == "0"
    assert "GGML_CPU_TILED_MM" not in server.environment(settings, ngrams, tiled=True)
    assert "--spec-type" not in server.llama_server_args("/m/model.gguf", settings, 2, "/s.sock")
    for flag in ("-md", "--spec-type", "--spec-draft-n-max", "-ctkd"):
        with pytest.raises(FlexoffloadError, match="serve's own"):
            server.llama_server_args("/m/model.gguf", settings, 2, "/s.sock", (flag, "x"))


@pytest.fixture(scope="module")
def kquant_draft(kquant_model, tmp_path_factory) -> Path:
    """A draft with the K-quant target's vocabulary: two layers of its shape (its output matrix drawn after them, so
    it is not the target's: its drafts are mostly rejected)."""
    shape = synth.Shape(n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, n_vocab=384, n_ctx_train=2048)
    return synth.write(tmp_path_factory.mktemp("models") / "draft.gguf", shape)


SPECULATION_PROMPTS = ["1 2 3 4 5", "q r s", "m n o p m n o p m n o p"]  # the target's greedy text repeats itself


@pytest.mark.parametrize("how", ["ngram-simple", "draft", "draft-is-target"])
def test_speculating_server_gives_runs_greedy_text(kquant_model, kquant_draft, how, monkeypatch):
    """llama-server's own speculation (an n-gram drafter; a draft model whose drafts are mostly rejected; the target
    as its own draft, every draft accepted): three clients at once on two sequences, each greedy text is `run`'s for
    its prompt alone (the near-tie K-quant model: a pass that rounded otherwise would show), and the responses'
    timings count drafts: short ones where they are rejected, the longest where accepted (patch 0030). Both sides with row-by-row kernels (serve sets them for speculation itself)."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    alone = {p: run_text(kquant_model, p, 128, "-c", "1024") for p in SPECULATION_PROMPTS}
    flags = {"ngram-simple": ["--spec-type", "ngram-simple"], "draft": ["-md", str(kquant_draft)],
             "draft-is-target": ["-md", str(kquant_model), "--draft-max", "4"]}[how]
    monkeypatch.delenv("GGML_CPU_TILED_MM")  # the server's own environment says it
    with Serving("-m", str(kquant_model), "-c", "1024", "-np", "2", *flags) as s:
        ready = "".join(s.lines)
        assert {"ngram-simple": "speculating: ngram-simple up to 16 tokens",
                "draft": "speculating: draft.gguf drafts 8",
                "draft-is-target": "speculating: kquant.gguf drafts 4"}[how] in ready, ready
        cmd = Path(f"/proc/{s.server_pid}/cmdline").read_bytes().split(b"\0")
        assert cmd[cmd.index(b"--spec-type") + 1] == (b"ngram-simple" if how == "ngram-simple" else b"draft-simple")
        env = Path(f"/proc/{s.server_pid}/environ").read_bytes().split(b"\0")
        assert b"GGML_CPU_TILED_MM=0" in env

        def ask(prompt):
            status, answer = s.request("POST", "/v1/completions", json.dumps(
                {"prompt": prompt, "max_tokens": 128, "temperature": 0}).encode())
            assert status == 200, answer
            return answer["choices"][0]["text"], answer["timings"]

        with ThreadPoolExecutor(3) as pool:
            answers = dict(zip(SPECULATION_PROMPTS, pool.map(ask, SPECULATION_PROMPTS)))
        assert {p: text for p, (text, _) in answers.items()} == alone
        drafted = sum(t.get("draft_n", 0) for _, t in answers.values())
        accepted = sum(t.get("draft_n_accepted", 0) for _, t in answers.values())
        assert drafted > 0, answers
        if how != "draft":
            assert accepted > 0, answers
        # a draft's length follows the sequence's measured acceptance (patch 0030): short where the target rejects
        # the draft (upstream drafts n-max, 8, every pass), n-max where it accepts every token
        passes = sum(t["predicted_n"] - 1 - t.get("draft_n_accepted", 0) for _, t in answers.values())
        if how == "draft":
            assert drafted / passes < 3, answers
        if how == "draft-is-target":
            assert accepted == drafted  # the target drafting itself: every draft is its own greedy token
            assert drafted / passes > 3, answers
        assert s.metric("llamacpp:tokens_predicted_total") == 3 * 128
        s.stop()


def test_the_servers_speculation_is_planned(kquant_model, kquant_draft, tmp_path):
    """prepare for a server (drafting.for_server): n-gram speculation's logits rows (each sequence's last token and
    a match's 16) are in the plan's compute buffers, a draft model's memory in its overhead (the API's draft_always:
    kept where the target alone is predicted faster); auto without a budget does not speculate (as run's auto), nor
    does a saved plan (said)."""
    from flexoffload import options
    from flexoffload.api.preparing import prepare
    from flexoffload.api.serving import speculation
    from flexoffload.measure import probe
    from flexoffload.runtime import server

    def prepared(**fields):
        request = options.Request(model=str(kquant_model), prompt=" ", n_ctx=1024, n_threads=2, strategy="stream",
                                  **fields)
        return prepare(request, n_seq_max=2, server=True)

    alone = prepared(mem="128M", spec_type="none")
    ngram = prepared(mem="128M", spec_type="ngram-simple")
    drafted = prepared(mem="128M", draft=str(kquant_draft), draft_always=True)
    assert speculation(alone) is None and alone.plan is not None
    assert speculation(ngram) == server.Speculation(None, ("ngram-simple",), 8, 16) and ngram.free == ("ngram-simple",)
    # the footprint probe made the target's context with 2 x (1 + 16) logits rows of the 384-token vocabulary
    assert ngram.plan.memory.compute > alone.plan.memory.compute
    assert probe.measure(ngram.model, 1024, 512, 2 * 17, 2).output >= 2 * 17 * 4 * 384
    assert speculation(drafted).draft == str(kquant_draft) and speculation(drafted).types == ("draft-simple",)
    assert drafted.draft_bytes > kquant_draft.stat().st_size  # its weights and its context
    # (each probe measures the target's heap anew: a few pages either way)
    assert abs(drafted.plan.memory.overhead - alone.plan.memory.overhead - drafted.draft_bytes) < 1 << 20
    assert speculation(prepared()) is None  # auto without a budget: the target alone, as run's auto
    saved = prepared(mem="128M", plan_dir=str(alone.write(tmp_path / "plan")), spec_type="ngram-simple")
    assert speculation(saved) is None and any("no room for the server's speculation" in n for n in saved.notes)


def test_speculation_that_does_not_fit_the_budget_serves_without_it(kquant_model, kquant_draft):
    """A budget that holds the target alone but not the draft beside it: serve says so and serves without -md (a
    default never refuses a budget the server without speculation takes); --spec-type recycle (run's own drafter,
    not llama-server's) is refused in one line."""
    r = cli("serve", "-m", str(kquant_model), "--port", "0", "-c", "1024", "-np", "2", "--mem", "1M")
    assert r.returncode != 0 and "the minimum is" in r.stderr, r.stderr
    minimum = r.stderr.split("the minimum is ")[1].split()[0]  # in MiB: the target alone's, rounded up
    with Serving("-m", str(kquant_model), "-c", "1024", "-np", "2", "--mem", f"{minimum}M",
                 "-md", str(kquant_draft)) as s:
        lines = "".join(s.lines)
        assert "does not fit beside the target at this budget" in lines and "server runs without it" in lines, lines
        assert "no speculation" in lines
        cmd = Path(f"/proc/{s.server_pid}/cmdline").read_bytes().split(b"\0")
        assert b"-md" not in cmd and b"--spec-type" not in cmd
        assert s.client().completions.create(model="any", prompt="a", max_tokens=4).usage.completion_tokens == 4
        s.stop()
    r = cli("serve", "-m", str(kquant_model), "--port", "0", "--spec-type", "recycle")
    assert r.returncode != 0 and "recycle is run's own drafter" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    """A synthetic qwen3moe (Qwen3-30B-A3B's pattern, small: 16 experts a layer, 4 used) whose experts are wide
    enough (nearly all of its 7 MiB) for a budget to stream them, and whose greedy text varies with the prompt."""
    shape = replace(synth.SHAPES["qwen3moe-tiny"], n_ff_expert=1024)
    return synth.write(tmp_path_factory.mktemp("models") / "moe.gguf", shape)


def test_a_mixture_of_experts_served_streamed_gives_llama_completions_text(moe_model):
    """A MoE end to end at the least budget: the plan streams its expert tensors (by expert: llama-server reads a
    token's routed experts, patch 0018), and each completion's greedy text is llama-completion's on the same file, in
    memory; the prompts' texts differ (the check is not one of a model that says the same whatever it is asked)."""
    flags = ["-c", "256", "-np", "2", "--strategy", "stream"]
    budget = minimum_mib(moe_model, *flags)
    with Serving("-m", str(moe_model), *flags, "--mem", f"{budget}M") as s:
        cmd = Path(f"/proc/{s.server_pid}/cmdline").read_bytes().split(b"\0")
        streamed = [part for part in cmd if part.endswith(b"=STREAMED")]
        assert any(b"ffn_up_exps" in part for part in streamed), streamed
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{s.server_pid}/environ").read_bytes().split(b"\0") if kv)
        assert b"LLAMA_STREAM_EXPERT_SLOTS" in env
        texts = {}
        for prompt in ("q r s t u v", "m n o p q"):
            status, answer = s.request("POST", "/v1/completions", json.dumps(
                {"prompt": prompt, "max_tokens": 24, "temperature": 0}).encode())
            assert status == 200, answer
            texts[prompt] = answer["choices"][0]["text"]
            assert texts[prompt] == llama_completion(moe_model, prompt, 24, ctx=256), prompt
        assert len(set(texts.values())) == 2
        assert s.metric("flexoffload_disk_read_bytes_per_pass") > 0  # the experts are read as tokens route to them
        s.stop()


def test_a_mixture_of_experts_served_to_concurrent_clients_under_enforce_gives_each_its_run_text(
        moe_model, tmp_path, monkeypatch):
    """Four clients at once on four sequences of a MoE streamed by expert, held to the least budget by a cgroup: a
    shared pass reads the union of its sequences' routed experts (the plan counts a batch's experts beyond the
    cache), and each greedy text is the one `run` gives its prompt alone. K-quants with the tiled kernels off, so
    the rounding is row by row at any batch size (as test_concurrent_clients_... does); llama-server held stopped
    until the four requests wait on its socket, so they share passes for certain."""
    from flexoffload import native

    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    model = tmp_path / "moe-kquant.gguf"
    subprocess.run([str(native.tool("llama-quantize")), "--allow-requantize", str(moe_model), str(model), "Q4_K_M"],
                   check=True, capture_output=True, timeout=300)
    prompts = ["q r s t u v", "m n o p q", "a b c", "x y z w"]
    alone = {p: run_text(model, p, 16, "-c", "512") for p in prompts}
    assert len(set(alone.values())) >= 3  # the prompt matters
    flags = ["-c", "512", "-np", "4", "--strategy", "stream"]
    budget = minimum_mib(model, *flags)
    with Serving("-m", str(model), *flags, "--mem", f"{budget}M", "--enforce") as s:
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{s.server_pid}/environ").read_bytes().split(b"\0") if kv)
        assert b"LLAMA_STREAM_EXPERT_SLOTS" in env  # streamed by expert, a cache of slots
        client = s.client()

        def ask(p):
            return client.completions.create(model="any", prompt=p, max_tokens=16, temperature=0).choices[0].text

        os.kill(s.server_pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(4) as pool:
                answers = [pool.submit(ask, p) for p in prompts]
                deadline = time.time() + 60
                while waiting_connections(s.socket_dir / "llama.sock") < 4:
                    assert time.time() < deadline, "four requests did not reach llama-server"
                    time.sleep(0.02)
                os.kill(s.server_pid, signal.SIGCONT)
                answers = [a.result(timeout=300) for a in answers]
        finally:
            os.kill(s.server_pid, signal.SIGCONT)
        assert answers == [alone[p] for p in prompts]
        assert s.metric("llamacpp:n_busy_slots_per_decode") > 2  # four sequences a pass, their prompts' ends apart
        assert s.metric("flexoffload_disk_read_bytes_per_pass") > 0  # the experts read as the union routes
        assert s.metric("flexoffload_memory_enforced") == 1
        assert 0 < s.metric("flexoffload_memory_peak_bytes") <= budget << 20
        s.stop()


def test_the_front_is_loaded_only_by_serve():
    """aiohttp (18 MiB of Python's memory) is imported when serve starts, not with runtime.server, which the api (and
    so every `run`, whose budget counts its process's memory) imports."""
    code = "import sys, flexoffload.api, flexoffload.runtime.server; print('aiohttp' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


@pytest.mark.integration
def test_real_model_concurrent_greedy_equals_run_under_a_budget(real_model, monkeypatch):
    """The real 1.5B (K-quants) at 0.5x of its size, enforced, four clients at once on four sequences: each greedy
    text is `run`'s for its prompt alone (kernels row by row on both sides, as in the test above), the server
    streams (bytes read per pass) and the cgroup's peak stays within the budget."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    prompts = ["def quicksort(arr):", "def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):"]
    alone = {p: run_text(real_model, p, 24, "-c", "1024") for p in prompts}
    with Serving("-m", str(real_model), "-c", "1024", "-np", "4", "--mem", "0.5x", "--enforce") as s:
        client = s.client()
        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(lambda p: client.completions.create(
                model="any", prompt=p, max_tokens=24, temperature=0).choices[0].text, prompts))
        assert dict(zip(prompts, texts)) == alone
        assert "return" in "".join(texts)  # a real model writes real code
        budget = s.metric("flexoffload_memory_budget_bytes")
        assert 0 < s.metric("flexoffload_memory_peak_bytes") <= budget
        assert s.metric("flexoffload_disk_read_bytes_per_pass") > 0  # it streams
        s.stop()


@pytest.fixture(scope="module")
def draft_model() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct: the 1.5B's vocabulary, a draft for it."""
    entry = catalog.CATALOG["qwen2.5-coder-0.5b-instruct"]
    if not catalog.is_present(entry):
        pytest.fail(f"{entry.name} is not fetched: run `flexoffload models fetch` (make test does)")
    return catalog.model_path(entry)


# a prompt whose continuation repeats it (self.y = y): n-gram drafts the 1.5B accepts
REPEATING_CODE = ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\n"
                  "class Point3:\n    def __init__(self, x, y, z):\n        self.x = x\n")


def ask_all(s: Serving, prompts: list[str], n: int) -> dict[str, tuple[str, dict]]:
    """Each prompt's greedy text and timings, the prompts sent at once."""
    def ask(prompt):
        status, answer = s.request("POST", "/v1/completions", json.dumps(
            {"prompt": prompt, "max_tokens": n, "temperature": 0}).encode(), timeout=900)  # the real model, 2 cores
        assert status == 200, answer
        return answer["choices"][0]["text"], answer["timings"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return dict(zip(prompts, pool.map(ask, prompts)))


@pytest.mark.integration
def test_real_model_speculating_server_equals_run(real_model, draft_model, monkeypatch):
    """The real 1.5B with the 0.5B as llama-server's draft (draft-simple), three clients on two sequences: each greedy
    text is `run`'s for its prompt alone (both with row-by-row kernels), drafts are made and accepted."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    prompts = ["def quicksort(arr):", "class Stack:", REPEATING_CODE]
    alone = {p: run_text(real_model, p, 32, "-c", "1024") for p in prompts}
    with Serving("-m", str(real_model), "-c", "1024", "-np", "2", "-md", str(draft_model)) as s:
        assert "speculating: qwen2.5-coder-0.5b-instruct.gguf drafts 8" in "".join(s.lines)
        answers = ask_all(s, prompts, 32)
        assert {p: text for p, (text, _) in answers.items()} == alone
        assert sum(t.get("draft_n_accepted", 0) for _, t in answers.values()) > 0, answers
        s.stop()


@pytest.mark.integration
def test_real_model_ngram_speculation_under_an_enforced_budget_equals_run(real_model, monkeypatch):
    """The real 1.5B at 0.4x, enforced, with llama-server's ngram-simple: the plan counts its logits rows, the cgroup's
    peak stays within the budget, a prompt that repeats has drafts accepted, and each text is `run`'s alone."""
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    prompts = [REPEATING_CODE, "def fibonacci(n):"]
    alone = {p: run_text(real_model, p, 32, "-c", "1024") for p in prompts}
    with Serving("-m", str(real_model), "-c", "1024", "-np", "2", "--mem", "0.4x", "--enforce",
                 "--spec-type", "ngram-simple") as s:
        assert "speculating: ngram-simple up to 16 tokens" in "".join(s.lines) and "enforced" in "".join(s.lines)
        answers = ask_all(s, prompts, 32)
        assert {p: text for p, (text, _) in answers.items()} == alone
        assert answers[REPEATING_CODE][1].get("draft_n_accepted", 0) > 0, answers
        assert 0 < s.metric("flexoffload_memory_peak_bytes") <= s.metric("flexoffload_memory_budget_bytes")
        assert s.metric("flexoffload_disk_read_bytes_per_pass") > 0  # it streams
        s.stop()
