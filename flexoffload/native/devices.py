"""Backends a plan can place tensors on: this machine's (llama.cpp's device registry) and RPC servers.

Local devices come from ggml's backend registry (ggml-backend.h): the CPU, and CUDA, Metal or Vulkan where the
native build has them. The CPU's extra buffer types (repacked weights, AMX tiles) are placements too: faster for
some operators, and they cost memory of their own, so each is listed with its device.

An RPC server (llama.cpp's ggml-rpc-server, one per machine) is asked here, in Python, over its own protocol
(ggml-rpc.cpp: | cmd: 1 byte | size: 8 bytes | data |, the response | size: 8 bytes | data |): HELLO, DEVICE_COUNT,
GET_DEVICE_MEMORY. llama.cpp's client aborts the process on an unreachable server or a failed handshake (no
timeout, GGML_ABORT), so every server is probed this way, with a timeout, before llama.cpp connects to it. The
server serves one client at a time: the probe closes its connection before a run opens one. `measure_link` times a
link the same way: round trips of a small command, and a buffer's worth of data set on the server and read back.
"""

from __future__ import annotations

import ctypes
import re
import socket
import statistics
import struct
import time
from dataclasses import asdict, dataclass, field

from flexoffload import FlexoffloadError

RPC_PORT = 50052  # ggml-rpc-server's default
RPC_PROTO_MAJOR = 7  # ggml/include/ggml-rpc.h in the pinned tree
RPC_PROTO_MINOR = 0
RPC_CONN_CAPS_SIZE = 24  # ggml/src/ggml-rpc/transport.h
RPC_CMD_ALLOC_BUFFER = 0
RPC_CMD_BUFFER_GET_BASE = 3
RPC_CMD_FREE_BUFFER = 4
RPC_CMD_SET_TENSOR = 6
RPC_CMD_GET_TENSOR = 8
RPC_CMD_GET_DEVICE_MEMORY = 11
RPC_CMD_HELLO = 14
RPC_CMD_DEVICE_COUNT = 15
RPC_TIMEOUT = 5.0  # seconds for a probe's connect and each reply

DEV_TYPES = {0: "CPU", 1: "GPU", 2: "IGPU", 3: "ACCEL"}  # enum ggml_backend_dev_type


@dataclass(frozen=True)
class Device:
    """A backend device: its llama.cpp name (what a buffer type is named after), kind and memory."""
    name: str  # CPU, CUDA0, RPC0[10.0.0.2:50052] (an RPC device: its buffer type's name, what -ot matches)
    kind: str  # CPU, GPU, IGPU, ACCEL, RPC
    description: str
    free: int
    total: int
    buffer_types: tuple[str, ...] = field(default=())  # beside the default one: the CPU's repack, AMX, ...

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "description": self.description, "free": self.free,
                "total": self.total, "buffer_types": list(self.buffer_types)}


def local() -> list[Device]:
    """This machine's devices, as the native build's ggml registry lists them."""
    from flexoffload import native

    native.llama_cpp()  # loads and initialises libggml with libllama
    ggml = ctypes.CDLL(str(native.build_dir() / "libggml.so"))
    base = ctypes.CDLL(str(native.build_dir() / "libggml-base.so"))
    p = ctypes.c_void_p
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.argtypes, ggml.ggml_backend_dev_get.restype = [ctypes.c_size_t], p
    for name in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
        getattr(base, name).argtypes, getattr(base, name).restype = [p], ctypes.c_char_p
    base.ggml_backend_dev_type.argtypes, base.ggml_backend_dev_type.restype = [p], ctypes.c_int
    base.ggml_backend_dev_memory.argtypes = [p, ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
    base.ggml_backend_dev_backend_reg.argtypes, base.ggml_backend_dev_backend_reg.restype = [p], p
    base.ggml_backend_reg_get_proc_address.argtypes = [p, ctypes.c_char_p]
    base.ggml_backend_reg_get_proc_address.restype = p
    base.ggml_backend_buft_name.argtypes, base.ggml_backend_buft_name.restype = [p], ctypes.c_char_p

    devices = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        base.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        extra = []
        # the extra buffer types a device offers (llama-model.cpp asks the same way): a NULL-terminated array
        get_extra = base.ggml_backend_reg_get_proc_address(base.ggml_backend_dev_backend_reg(dev),
                                                           b"ggml_backend_dev_get_extra_bufts")
        if get_extra:
            bufts = ctypes.CFUNCTYPE(ctypes.POINTER(p), p)(get_extra)(dev)
            j = 0
            while bufts and bufts[j]:
                extra.append(base.ggml_backend_buft_name(bufts[j]).decode())
                j += 1
        devices.append(Device(name=base.ggml_backend_dev_name(dev).decode(),
                              kind=DEV_TYPES.get(base.ggml_backend_dev_type(dev), "?"),
                              description=base.ggml_backend_dev_description(dev).decode(),
                              free=free.value, total=total.value, buffer_types=tuple(extra)))
    return devices


def parse_endpoints(text: str) -> list[str]:
    """'a:50052,b' -> ['a:50052', 'b:50052'], as llama.cpp's --rpc takes them (a port is needed there)."""
    endpoints = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep:
            host, port = part, str(RPC_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise FlexoffloadError(f"cannot read RPC server {part!r}: use HOST:PORT, e.g. 10.0.0.2:{RPC_PORT}")
        endpoints.append(f"{host}:{int(port)}")
    if not endpoints:
        raise FlexoffloadError("--rpc names no server: use HOST:PORT[,HOST:PORT...]")
    return endpoints


class _NotRpc(Exception):
    """The peer answered, but not as ggml-rpc-server does."""


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def _send(sock: socket.socket, cmd: int, request: bytes) -> None:
    """A command without a response (| cmd | size | data |)."""
    sock.sendall(struct.pack("<BQ", cmd, len(request)) + request)


def _call(sock: socket.socket, cmd: int, request: bytes, response_size: int) -> bytes:
    _send(sock, cmd, request)
    (size,) = struct.unpack("<Q", _recv(sock, 8))
    if size != response_size:
        raise _NotRpc(f"a reply of {size} bytes where {response_size} were expected")
    return _recv(sock, size)


def probe_rpc(endpoint: str, timeout: float = RPC_TIMEOUT) -> list[Device]:
    """The devices of the RPC server at endpoint (host:port), or a one-line error saying why there are none."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as sock:
            sock.settimeout(timeout)
            hello = _call(sock, RPC_CMD_HELLO, bytes(RPC_CONN_CAPS_SIZE), 4 + RPC_CONN_CAPS_SIZE)
            major, minor, patch = hello[0], hello[1], hello[2]
            if major != RPC_PROTO_MAJOR or minor > RPC_PROTO_MINOR:
                raise FlexoffloadError(f"RPC server {endpoint} speaks protocol {major}.{minor}.{patch}; this build "
                                       f"speaks {RPC_PROTO_MAJOR}.{RPC_PROTO_MINOR}: run the same llama.cpp on both")
            (count,) = struct.unpack("<I", _call(sock, RPC_CMD_DEVICE_COUNT, b"", 4))
            devices = []
            for i in range(count):
                free, total = struct.unpack("<QQ", _call(sock, RPC_CMD_GET_DEVICE_MEMORY, struct.pack("<I", i), 16))
                devices.append(Device(name=f"RPC{i}[{endpoint}]", kind="RPC", description=f"device {i} of {endpoint}",
                                      free=free, total=total))
            return devices
    except _NotRpc as e:
        raise FlexoffloadError(f"{endpoint} did not answer as ggml-rpc-server does ({e}): is it one, of this "
                               f"llama.cpp?") from None
    except socket.timeout:
        raise FlexoffloadError(f"RPC server {endpoint} did not answer within {timeout:g} s") from None
    except ConnectionRefusedError:
        raise FlexoffloadError(f"RPC server {endpoint} refused the connection: is ggml-rpc-server running "
                               f"there (-H HOST -p PORT)?") from None
    except (OSError, ConnectionError, ValueError) as e:
        raise FlexoffloadError(f"RPC server {endpoint} is unreachable: {e}") from None


def stopped(endpoints: list[str], timeout: float = 2.0) -> list[str]:
    """Those of endpoints whose server no longer answers a probe (after a run or a profile over them failed)."""
    out = []
    for endpoint in endpoints:
        try:
            probe_rpc(endpoint, timeout)
        except FlexoffloadError:
            out.append(endpoint)
    return out


def failure(endpoints: list[str], what: str, stderr: str, returncode: int) -> str:
    """One line for a child process over RPC servers that failed: the server that stopped answering while `what`
    ran (out of memory, most likely: a server in a container is killed at its limit), else the child's own error
    (its last `flexoffload:` line; llama.cpp's abort prints a backtrace, never shown)."""
    gone = stopped(endpoints)
    if gone:
        return (f"the RPC server at {', '.join(gone)} stopped answering while {what}: out of memory? (give it a "
                f"budget: --mem cpu=SIZE,rpc0=SIZE,...)")
    ours = [line for line in stderr.splitlines() if line.startswith("flexoffload: ")]
    if ours:
        return ours[-1].removeprefix("flexoffload: ")
    return f"{what} failed (exit {returncode})"


_rpc_devices: dict[str, list[int]] = {}  # endpoint -> its ggml_backend_dev_t handles, registered once a process


def _ggml(name: str) -> ctypes.CDLL:
    from flexoffload import native

    native.llama_cpp()
    return ctypes.CDLL(str(native.build_dir() / name))


def register_rpc(endpoints: list[str]) -> list[int]:
    """Register RPC servers with ggml (as llama.cpp's --rpc does), each probed first: their devices' handles, for
    llama_model_params.devices."""
    try:
        rpc = _ggml("libggml-rpc.so")
    except OSError:
        raise FlexoffloadError("this native build has no RPC backend: rebuild with `make setup` "
                               "(scripts/build_native builds with GGML_RPC=ON)") from None
    base, registry = _ggml("libggml-base.so"), _ggml("libggml.so")
    p = ctypes.c_void_p
    rpc.ggml_backend_rpc_add_server.argtypes, rpc.ggml_backend_rpc_add_server.restype = [ctypes.c_char_p], p
    registry.ggml_backend_register.argtypes = [p]
    base.ggml_backend_reg_dev_count.argtypes, base.ggml_backend_reg_dev_count.restype = [p], ctypes.c_size_t
    base.ggml_backend_reg_dev_get.argtypes, base.ggml_backend_reg_dev_get.restype = [p, ctypes.c_size_t], p
    handles = []
    for endpoint in endpoints:
        if endpoint not in _rpc_devices:
            probe_rpc(endpoint)  # llama.cpp aborts where this raises a one-line error
            reg = rpc.ggml_backend_rpc_add_server(endpoint.encode())
            if not reg:
                raise FlexoffloadError(f"RPC server {endpoint} has no devices")
            registry.ggml_backend_register(reg)
            _rpc_devices[endpoint] = [base.ggml_backend_reg_dev_get(reg, i)
                                      for i in range(base.ggml_backend_reg_dev_count(reg))]
        handles += _rpc_devices[endpoint]
    return handles


_RPC_BUFT = re.compile(r"^RPC(\d+)\[(.+:\d+)\]$")


def buffer_type(name: str) -> int:
    """The ggml buffer type llama.cpp names `name` (a tensors.ot line's right side), for a tensor override:
    RPC<device>[host:port] (its server registered first: register_rpc), or CPU (a tensor a layer assignment
    would put on a device, kept on the host)."""
    if name == "CPU":
        base = _ggml("libggml-base.so")
        base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
        return base.ggml_backend_cpu_buffer_type()
    m = _RPC_BUFT.match(name)
    if not m:
        raise FlexoffloadError(f"unknown buffer type {name!r}: this build places tensors on STREAMED, CPU or "
                               f"RPC<i>[HOST:PORT]")
    if m.group(2) not in _rpc_devices:
        raise FlexoffloadError(f"{name}: its RPC server {m.group(2)} is not among --rpc")
    rpc = _ggml("libggml-rpc.so")
    rpc.ggml_backend_rpc_buffer_type.argtypes = [ctypes.c_char_p, ctypes.c_uint32]
    rpc.ggml_backend_rpc_buffer_type.restype = ctypes.c_void_p
    return rpc.ggml_backend_rpc_buffer_type(m.group(2).encode(), int(m.group(1)))


@dataclass(frozen=True)
class Link:
    """The link to an RPC server as its protocol sees it: a small request's round trip, and bytes a second each way
    (a tensor's data set on the server and read back, as llama.cpp moves activations)."""
    endpoint: str
    latency_s: float  # median round trip of a small command
    send_bw: float  # bytes/s, client to server
    recv_bw: float  # bytes/s, server to client

    def to_dict(self) -> dict:
        return asdict(self)


def _rpc_tensor(buffer: int, data: int, n_bytes: int) -> bytes:
    """A packed rpc_tensor (ggml-rpc.cpp): an F32 vector of n_bytes at data in buffer."""
    ne, nb = (n_bytes // 4, 1, 1, 1), (4, n_bytes, n_bytes, n_bytes)
    return (struct.pack("<QIQ4I4II", 0, 0, buffer, *ne, *nb, 0) + bytes(16 * 4) + struct.pack("<i", 0)
            + bytes(10 * 8) + struct.pack("<QQQ", 0, 0, data) + bytes(64) + struct.pack("<i", 0))


def measure_link(endpoint: str, n_bytes: int = 8 << 20, repeats: int = 3, timeout: float = 60.0) -> Link:
    """Time the link to an RPC server: round trips of GET_DEVICE_MEMORY, and n_bytes set into a buffer allocated on
    it (then a round trip, so the server has taken them all) and read back (GET_TENSOR); the best of repeats, less
    a round trip. The buffer is freed afterwards."""
    probe_rpc(endpoint)
    host, _, port = endpoint.rpartition(":")
    n_bytes -= n_bytes % 4
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.settimeout(timeout)
        _call(sock, RPC_CMD_HELLO, bytes(RPC_CONN_CAPS_SIZE), 4 + RPC_CONN_CAPS_SIZE)
        ask_memory = struct.pack("<I", 0)
        trips = []
        for _ in range(20):
            t0 = time.perf_counter()
            _call(sock, RPC_CMD_GET_DEVICE_MEMORY, ask_memory, 16)
            trips.append(time.perf_counter() - t0)
        latency = statistics.median(trips)
        remote, size = struct.unpack("<QQ", _call(sock, RPC_CMD_ALLOC_BUFFER, struct.pack("<IQ", 0, n_bytes), 16))
        if remote == 0 or size < n_bytes:
            raise FlexoffloadError(f"RPC server {endpoint} could not allocate {n_bytes} bytes to time its link")
        try:
            (base,) = struct.unpack("<Q", _call(sock, RPC_CMD_BUFFER_GET_BASE, struct.pack("<Q", remote), 8))
            tensor = _rpc_tensor(remote, base, n_bytes)
            payload = bytes(n_bytes)
            send, recv = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                _send(sock, RPC_CMD_SET_TENSOR, tensor + b"\0" + struct.pack("<Q", 0) + payload)
                _call(sock, RPC_CMD_GET_DEVICE_MEMORY, ask_memory, 16)
                send.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                _call(sock, RPC_CMD_GET_TENSOR, tensor + struct.pack("<QQ", 0, n_bytes), n_bytes)
                recv.append(time.perf_counter() - t0)
        finally:
            _send(sock, RPC_CMD_FREE_BUFFER, struct.pack("<Q", remote))
            _call(sock, RPC_CMD_GET_DEVICE_MEMORY, ask_memory, 16)  # the free is done before the socket closes
    return Link(endpoint, latency, n_bytes / max(min(send) - latency, 1e-9),
                n_bytes / max(min(recv) - latency, 1e-9))
