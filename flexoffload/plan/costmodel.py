"""The one cost model under every planner: predicted seconds per decoded token for a set of resident tensors.

A decode step runs the model's stages in order: the layers blk.0 … blk.N-1, with token_embd before them and the
output head (output_norm, output, sampling) after. Streamed tensors are read from disk into a prefetch window:
with window k the reads for stage g may start once stage g-k-1 has finished computing (its buffer is free again),
so up to k+1 stages' streamed bytes are in memory at once (the one computing and k read ahead); window 0 is
synchronous reading. Reads go one stage after another, a stage's tensors spread over the I/O threads. A stage
computes once the previous stage has and its own tensors are in.

That recurrence is simulated exactly, over a few tokens until the time per token is steady (the window wraps to
the next token's first layer), rather than summing max(compute, io) per layer: with a big window it tends to
max(total compute, total read) (FlexInfer's formula 4), with a small one per-stage imbalance costs time, and with
window 0 it is the sum of both (formula 3). token_embd and the output head are stages of their own only when
something of theirs streams; otherwise their (resident) compute runs as part of the first and last layer, so the
window counts layers, as the runtime's prefetcher does (design.md: read layer L+k while L computes).

A streamed token_embd is not read whole: decode looks up one row of it (get_rows), and the runtime reads just the
rows a pass looks up, synchronously when compute needs them, into pages it gives back right after (`reads_rows`).
Its stage then has no prefetch read and no window buffer: the row's read is part of its compute, and its memory
is the pages of ROWS_CHUNK rows, counted beside the window (`rows_memory`). Where the output matrix is tied to
token_embd, the tensor is also in the output head's stage, read there whole or in chunks like an output matrix.

A streamed tensor larger than CHUNK_BYTES (the output matrix: 183 MiB on the 1.5B) is read in row chunks, each its
own read request into its own buffer, given back as soon as the matrix multiplication is done with it (patch 0007):
it holds CHUNKS_IN_FLIGHT chunks of buffer at a time, not itself (`held_bytes`), while a pass still reads all of it.
A stage's window share is what its tensors hold (`Stage.held_bytes`), its read what they weigh. Only the chunks it
holds can be read ahead; the rest is read while the stage computes, each chunk when one before it is done
(`Stage.late_read_s`), and the disk does nothing else meanwhile. That part of a streamed output matrix is not
hidden behind the layers' compute. Streamed, it still measures slower than this predicts (planners/balanced.py,
OUTPUT_MARGIN).

Simplifications: a stage computes only once all its tensors are in (the runtime waits per tensor, so it can start
a little earlier; a chunked tensor's late chunks compute as they arrive, so their read overlaps its own compute); reads are bandwidth plus per-request latency, without seek or jitter; compute does not depend
on whether a weight was streamed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field

from flexoffload.defaults import CHUNK_BYTES
from flexoffload.gguf.model import Model, Tensor
from flexoffload.plan.pipeline import Prediction, Stage, simulate

# Kinds whose weights a decode step reads in full by a matrix multiplication.
MATMUL_KINDS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "output"})

# A streamed tensor used only by GET_ROWS is read by rows, at most this many at a time, into the pages holding them
# (the runtime's GGML_CPU_STREAMED_ROWS_CHUNK, patch 0006); pages are of this size (O_DIRECT's alignment).
ROWS_CHUNK = 32
PAGE = 4096

# A streamed tensor larger than CHUNK_BYTES is read in row chunks of at most that many bytes (`chunk_rows`), and holds
# at most CHUNKS_IN_FLIGHT of them in the read pool: the runtime's GGML_CPU_STREAMED_CHUNKS_IN_FLIGHT (patch 0007).
CHUNKS_IN_FLIGHT = 2


def row_bytes(t: Tensor) -> int:
    """Bytes of one row (ggml's ne1 indexes the rows: a token's embedding)."""
    rows = t.shape[-1] if len(t.shape) > 1 else 1
    return t.n_bytes // rows


def chunk_rows(t: Tensor, chunk_bytes: int = CHUNK_BYTES) -> int | None:
    """Rows per chunk the runtime reads t in when it streams, None if it reads t whole (chunking off, t not larger
    than a chunk, or not 2-D). As the runtime splits: as few chunks of at most chunk_bytes as will do, of about
    equal size (whole rows; a multiple of 64 when a chunk holds at least 64 rows), the last one the rest."""
    if chunk_bytes <= 0 or t.n_bytes <= chunk_bytes or len(t.shape) != 2:
        return None
    n_rows = t.shape[-1]
    rows_max = max(1, chunk_bytes // row_bytes(t))
    if rows_max >= 64:
        rows_max -= rows_max % 64
    if rows_max >= n_rows:
        return None
    n_chunks = -(-n_rows // rows_max)
    rows = -(-n_rows // n_chunks)
    return -(-rows // 64) * 64 if rows_max >= 64 else rows


def held_bytes(t: Tensor, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Read-pool memory t holds at a time when it streams: itself, or CHUNKS_IN_FLIGHT of its chunks (each takes
    the room of the largest)."""
    rows = chunk_rows(t, chunk_bytes)
    if rows is None:
        return t.n_bytes
    return min(read_requests(t, chunk_bytes), CHUNKS_IN_FLIGHT) * rows * row_bytes(t)


def read_requests(t: Tensor, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Read requests a pass makes for t when it streams whole or chunked: one a chunk."""
    rows = chunk_rows(t, chunk_bytes)
    return 1 if rows is None else -(-t.shape[-1] // rows)


def reads_rows(model: Model, t: Tensor, chunk_bytes: int = CHUNK_BYTES) -> bool:
    """Whether a lookup in t reads only the looked-up rows when t streams: token_embd. Where the output matrix is
    tied to it (no output.weight), the output's matmul reads all of it as well, in row chunks (patch 0007); a
    lookup then reads rows only if t is chunked (else the runtime, seeing t used by a matmul, reads it whole)."""
    return t.kind == "token_embd" and (not model.tied_embeddings or chunk_rows(t, chunk_bytes) is not None)


def looked_up_only(model: Model, t: Tensor) -> bool:
    """Whether a pass needs only the looked-up rows of t: token_embd, unless the output is tied to it."""
    return t.kind == "token_embd" and not model.tied_embeddings


def tied_output(model: Model) -> list[Tensor]:
    """The token_embd that is also the output matrix (no output.weight), as a list of it or nothing."""
    return [t for t in model.tensors if t.kind == "token_embd" and model.tied_embeddings]


def rows_memory(t: Tensor) -> int:
    """Memory a row-read tensor takes while a lookup computes: the pages of ROWS_CHUNK rows (a row may straddle
    two), never more than the tensor's own pages."""
    per_row = (-(-row_bytes(t) // PAGE) + 1) * PAGE
    return min(ROWS_CHUNK * per_row, -(-t.n_bytes // PAGE) * PAGE + PAGE)


@dataclass(frozen=True)
class Profile:
    """What the machine does: disk bandwidth and per-request latency, and compute time per decoded token.

    Compute is seconds per byte of weights a matmul reads, by ggml type (decode on a CPU is bound by how fast it
    streams weights through the cores, so time follows bytes; measured per type where known), plus a fixed time per
    layer (attention over the KV cache, norms, rope, adds) and per token (output softmax, sampling, graph launch).
    """

    disk_bw: float  # bytes/s of O_DIRECT reads
    io_latency: float = 100e-6  # seconds per read request, overlapped across I/O threads
    # compute defaults are placeholders of the right order for 2 CPU cores; `calibrated` or a measurement sets them
    sec_per_byte: Mapping[str, float] = field(default_factory=dict)  # by ggml type name
    default_sec_per_byte: float = 7e-11  # for types not in sec_per_byte
    layer_overhead: float = 50e-6  # seconds per layer per token
    token_overhead: float = 2e-3  # seconds per token
    peak_disk_bw: float = 0.0  # the best bandwidth this device has shown, for the roofline (0: unknown)
    # a mixture of experts' reads once a router has chosen (measure/profiler.py, expert_reads): a burst of expert
    # slices takes expert_read_latency plus its bytes at expert_read_bw (0: not measured)
    expert_read_bw: float = 0.0
    expert_read_latency: float = 0.0

    def seconds_per_byte(self, ggml_type: str) -> float:
        return self.sec_per_byte.get(ggml_type, self.default_sec_per_byte)

    def compute_seconds(self, t: Tensor) -> float:
        """Compute time of one tensor's op in a decode step. token_embd is only looked up (get_rows: one row)."""
        if t.kind in MATMUL_KINDS:
            return t.n_bytes * self.seconds_per_byte(t.type)
        if t.kind == "token_embd":
            rows = t.shape[-1] if len(t.shape) > 1 else 1
            return t.n_bytes / rows * self.seconds_per_byte(t.type)
        return 0.0  # norms, biases, others: part of layer_overhead

    def read_seconds(self, n_bytes: int, n_requests: int, io_threads: int) -> float:
        """One stage's reads: the bytes at full bandwidth, the requests' latency overlapped across the threads."""
        if n_requests == 0:
            return 0.0
        return n_bytes / self.disk_bw + math.ceil(n_requests / io_threads) * self.io_latency

    def expert_read_seconds(self, n_bytes: int, n_requests: int, io_threads: int) -> float:
        """One layer's expert reads after its router: the measured burst of slice reads where known, else as a
        stage's reads (large ones, which this disk serves two to three times faster than expert slices)."""
        if n_requests == 0:
            return 0.0
        if self.expert_read_bw > 0:
            return self.expert_read_latency + n_bytes / self.expert_read_bw
        return self.read_seconds(n_bytes, n_requests, io_threads)

    @classmethod
    def calibrated(cls, model: Model, tok_s: float, disk_bw: float, io_latency: float = 100e-6,
                   overhead_share: float = 0.1) -> "Profile":
        """A profile from one measured number: decode tok/s with all weights in memory.

        `overhead_share` of that time goes to fixed overheads (4/5 spread over the layers, 1/5 per token); the rest
        is spread over the matmul bytes, the same per byte for every type.
        """
        t = 1.0 / tok_s
        unit = cls(disk_bw=disk_bw, default_sec_per_byte=1.0)
        # by matmuls, token_embd's row, token_embd whole where the output is tied to it, and the routed experts'
        # share of the expert tensors (a token multiplies by those only)
        bytes_read = sum(unit.compute_seconds(x) for x in model.tensors) + sum(x.n_bytes for x in tied_output(model))
        bytes_read += sum(model.token_bytes(x) for x in model.tensors if x.kind == "expert")
        return cls(disk_bw=disk_bw, io_latency=io_latency,
                   default_sec_per_byte=t * (1 - overhead_share) / bytes_read,
                   layer_overhead=t * overhead_share * 0.8 / max(model.n_layer, 1),
                   token_overhead=t * overhead_share * 0.2)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["sec_per_byte"] = dict(self.sec_per_byte)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "Profile":
        return cls(**{**d, "sec_per_byte": dict(d.get("sec_per_byte", {}))})


@dataclass
class _Group:
    """A stage being assembled (Pipeline.stages): what its streamed tensors read and hold, and their requests."""

    name: str
    compute_s: float
    streamed_bytes: int
    requests: int
    n_streamed: int
    held_bytes: int
    late_bytes: int  # of a chunked tensor, beyond the chunks it can hold ahead
    late_requests: int


class Pipeline:
    """A model's stages under a profile, precomputed once to predict many resident sets fast (the planners do).

    Without a profile it still knows the stages and their streamed bytes (what memory accounting needs).
    """

    def __init__(self, model: Model, profile: Profile | None = None, io_threads: int = 1,
                 chunk_bytes: int = CHUNK_BYTES):
        profile = profile or Profile(disk_bw=1.0)
        if io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, not {io_threads}")
        if model.n_layer < 1:
            raise ValueError("a model without layers has no pipeline")
        self.profile, self.io_threads, self.n_layer = profile, io_threads, model.n_layer
        # groups: 0 = token_embd, 1..n_layer = the layers, n_layer+1 = the output head and any other tensor
        n_groups = model.n_layer + 2
        self.names = ["token_embd"] + [f"blk.{i}" for i in range(model.n_layer)] + ["output"]
        self.compute = [0.0] + [profile.layer_overhead] * model.n_layer + [profile.token_overhead]
        self.tensors: list[list[Tensor]] = [[] for _ in range(n_groups)]
        # read by rows when streamed, for the lookup in stage 0 (a tied token_embd is read whole or chunked in the head)
        self.rows = {t.name: t for t in model.tensors if reads_rows(model, t, chunk_bytes)}
        self.tied = {t.name for t in tied_output(model)}
        # read buffers each tensor holds when it streams whole or chunked, and its read requests a pass
        self.held = {t.name: held_bytes(t, chunk_bytes) for t in model.tensors}
        self.sizes = {t.name: t.n_bytes for t in model.tensors}
        self.requests = {t.name: read_requests(t, chunk_bytes) for t in model.tensors}
        # what a chunked tensor cannot read ahead: its bytes beyond the chunks it holds, and their requests
        self.late = {t.name: (t.n_bytes - self.held[t.name], self.requests[t.name] - CHUNKS_IN_FLIGHT)
                     for t in model.tensors if self.held[t.name] < t.n_bytes}
        for t in model.tensors:
            g = t.layer + 1 if t.layer is not None else (0 if t.kind == "token_embd" else n_groups - 1)
            self.tensors[g].append(t)
            self.compute[g] += profile.compute_seconds(t)
        for t in tied_output(model):  # token_embd is the output matrix too: a matmul a token, reading all of it
            self.tensors[n_groups - 1].append(t)
            self.compute[n_groups - 1] += t.n_bytes * profile.seconds_per_byte(t.type)

    def stages(self, resident: Collection[str]) -> list[Stage]:
        """The pipeline's stages for a resident set. token_embd and the head are stages only if they stream."""
        groups = []
        for g, tensors in enumerate(self.tensors):
            streamed = [t for t in tensors if t.name not in resident]
            # whole or chunked; a row-read tensor (its lookup, in stage 0): one row per decoded token, read when
            # compute needs it (no prefetch, no window)
            rows = self.rows if g == 0 else {}
            whole = [t.name for t in streamed if t.name not in rows]
            compute = self.compute[g] + sum(self.profile.read_seconds(row_bytes(t), 1, 1)
                                            for t in streamed if t.name in rows)
            late = [self.late[n] for n in whole if n in self.late]
            groups.append(_Group(name=self.names[g], compute_s=compute,
                                 streamed_bytes=sum(self.sizes[n] for n in whole),
                                 requests=sum(self.requests[n] for n in whole), n_streamed=len(streamed),
                                 held_bytes=sum(self.held[n] for n in whole),
                                 late_bytes=sum(b for b, _ in late), late_requests=sum(m for _, m in late)))
        head, embd = groups[-1], groups[0]
        if head.n_streamed == 0:  # resident head: computed right after the last layer
            groups[-2].compute_s += head.compute_s
            groups.pop()
        if embd.n_streamed == 0:
            groups[1].compute_s += embd.compute_s
            groups.pop(0)
        stages = []
        for g in groups:
            # the chunks a chunked tensor cannot hold ahead are read while it computes, CHUNKS_IN_FLIGHT at a time
            ahead_s = self.profile.read_seconds(g.streamed_bytes - g.late_bytes, g.requests - g.late_requests,
                                                self.io_threads)
            late_s = self.profile.read_seconds(g.late_bytes, g.late_requests, CHUNKS_IN_FLIGHT)
            stages.append(Stage(g.name, g.compute_s, ahead_s, g.streamed_bytes, g.n_streamed, g.held_bytes, late_s))
        return stages

    def predict(self, resident: Collection[str], window: int) -> Prediction:
        return simulate(self.stages(resident), window)

    def seconds(self, resident: Collection[str], window: int) -> float:
        return self.predict(resident, window).seconds_per_token

    def window_bytes(self, resident: Collection[str], window: int) -> int:
        """Memory for the prefetch buffers: the most bytes the streamed tensors of window+1 consecutive streaming
        stages (wrapping) hold (a chunked tensor: CHUNKS_IN_FLIGHT chunks), and the pages of the rows a streamed token_embd
        reads (rows_memory)."""
        ring = [s.held_bytes for s in self.stages(resident) if s.n_streamed]
        return window_bytes_of(ring, window) + self.rows_memory(resident)

    def rows_memory(self, resident: Collection[str]) -> int:
        """Memory of the streamed row-read tensors: a lookup's rows, not the tensor."""
        return sum(rows_memory(t) for name, t in self.rows.items() if name not in resident)

    def compute_seconds(self) -> float:
        """Compute time per token with every weight in memory."""
        return sum(self.compute)


def window_bytes_of(streamed: list[int], window: int) -> int:
    """The largest sum of window+1 cyclically consecutive entries of the runtime's ring (all of them if the window
    spans it). The ring has an entry only for a stage that streams (sched.cpp has a group only for those), so the
    window reaches past a resident layer to the next one that streams."""
    n, span = len(streamed), window + 1
    if span >= n:
        return sum(streamed)
    run = sum(streamed[:span])
    best = run
    for i in range(1, n):
        run += streamed[(i + span - 1) % n] - streamed[i - 1]
        best = max(best, run)
    return best


def predict(model: Model, resident: Collection[str], profile: Profile, window: int, io_threads: int) -> Prediction:
    """Predicted steady-state decode time per token, with the per-stage breakdown."""
    return Pipeline(model, profile, io_threads).predict(resident, window)


def window_bytes(model: Model, resident: Collection[str], window: int) -> int:
    """Bytes of prefetch buffers a resident set needs with this window."""
    return Pipeline(model).window_bytes(resident, window)


def compute_seconds(model: Model, profile: Profile) -> float:
    """Compute time per token with every weight in memory: the dense tensors' and a mixture of experts' routed
    experts' (expert_seconds)."""
    return Pipeline(model, profile).compute_seconds() + expert_seconds(model, profile)


def expert_seconds(model: Model, profile: Profile) -> float:
    """A decoded token's routed experts' compute (the Pipeline's stages count no expert tensor): their slices' bytes
    at the profile's speed, as Profile.calibrated counts them."""
    return sum(model.token_bytes(t) * profile.seconds_per_byte(t.type) for t in model.tensors if t.kind == "expert")


def roofline(model: Model, profile: Profile, budget_for_weights: int) -> float:
    """Tokens/s no plan can beat: 1 / max(compute per token, bytes that cannot be in memory / disk bandwidth).
    A looked-up-only tensor (token_embd) can stream for a row a token: only the rest of its bytes are missing ones."""
    by_rows = sum(t.n_bytes - row_bytes(t) for t in model.tensors if looked_up_only(model, t))
    missing = max(0, model.weight_bytes - by_rows - budget_for_weights)
    return 1.0 / max(compute_seconds(model, profile), missing / profile.disk_bw)


def mmap_touched(model: Model) -> int:
    """The weight bytes a decoded token touches under upstream mmap: all of them but a looked-up-only tensor's
    (token_embd), of which a lookup touches a row's pages."""
    return sum(row_bytes(t) if looked_up_only(model, t) else t.n_bytes for t in model.tensors)


def mmap_seconds(model: Model, profile: Profile, page_cache: int) -> float:
    """Seconds per token of upstream mmap with this much page cache beside the run's other memory.

    If the cache holds what a token touches, it is compute-bound once warm. If not, each pass over the layers
    evicts the pages the next pass needs first (a cyclic scan is the least-recently-used policy's worst case: seen
    on the matrix at 0.5x-1.1x, mmap at a fifth to a third of its in-memory speed), so every page is read again
    per token, synchronously, as compute faults on it."""
    touched = mmap_touched(model)
    compute = compute_seconds(model, profile)
    if page_cache >= touched:
        return compute
    return compute + touched / profile.disk_bw
