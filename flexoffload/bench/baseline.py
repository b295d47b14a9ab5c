"""llama.cpp's own speculative decoding (`llama-speculative`) as a baseline, run under a memory budget.

The pinned llama-speculative drafts a chain of up to `--spec-draft-n-max` tokens with the draft model (a tree
only with -np > 1; we keep its default of one sequence), verifies them in one target pass, and greedy
verification (`--temp 0`) keeps its output the target's own. Both models are memory-mapped (`-lm mmap`) without
repacking (`--no-repack`), as flexoffload's mmap strategy loads the target, so under a cgroup the kernel pages
both in and out of the budget.

What it prints, which `parse` reads: on stdout "\\n\\n", the prompt's tokens, the generated tokens, then "\\n\\n"
twice; on stderr "encoded N tokens in S seconds", "decoded N tokens in S seconds, speed: X t/s", n_draft,
n_predict, n_drafted (draft steps), n_accept and accept (%). It stops after the verification pass that takes it
past -n, so it generates a few tokens more than asked.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from flexoffload import FlexoffloadError
from flexoffload.memory import budgets
from flexoffload.memory.budgets import format_size
from flexoffload.native import tool


@dataclass
class Speculative:
    """One llama-speculative run."""
    text: str  # the generated text, without the prompt
    n_gen: int  # tokens generated (its n_predict: the -n asked for, plus the rest of the last accepted draft)
    n_prompt: int
    encode_s: float  # both models over the prompt: the time to the first token
    decode_s: float  # from the first token to the last
    decode_tok_s: float  # (n_gen - 1) / decode_s: tokens after the first over their time, as flexoffload counts
    reported_tok_s: float  # its own "speed": n_gen / decode_s
    n_draft: int  # --spec-draft-n-max
    n_drafted: int  # draft steps (with one sequence: drafted tokens)
    n_accept: int
    acceptance_rate: float  # n_accept / n_drafted (0 when nothing was drafted)
    tokens_per_pass: float = 0.0  # n_gen / target passes, as flexoffload counts it (n_gen / n_verify)
    n_verify: int = 0  # target passes after the prompt
    peak_mem_mb: float = 0.0
    enforced: bool = False
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class Incomplete(FlexoffloadError):
    """llama-speculative's output is incomplete: it stops before its trailer or lacks its timings."""


_NUM = r"([-+]?(?:\d+\.?\d*|inf|nan))"
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+" + _NUM + r" seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+" + _NUM + r" seconds, speed:\s+" + _NUM + r" t/s")
_COUNT = {name: re.compile(rf"\b{name}\s*=\s*(\d+)\s*$", re.MULTILINE)
          for name in ("n_draft", "n_predict", "n_drafted", "n_accept")}
_TRAILER = "\n\n\n\n"  # LOG("\n\n") after generation, and again before exit


def parse(stdout: str, stderr: str, prompt: str) -> Speculative:
    """The result of one llama-speculative run from its stdout and stderr, for the prompt it was given."""
    head = "\n\n" + prompt
    if not stdout.startswith(head):
        if head.startswith(stdout) or not stdout:
            raise Incomplete("llama-speculative's output stops before the prompt ends")
        raise FlexoffloadError("llama-speculative did not echo the prompt as given: "
                               f"{stdout[:80]!r} against {head[:80]!r}")
    if not stdout.endswith(_TRAILER) or len(stdout) < len(head) + len(_TRAILER):
        raise Incomplete("llama-speculative's output was cut short")
    encoded, decoded = _ENCODED.search(stderr), _DECODED.search(stderr)
    counts = {name: rx.search(stderr) for name, rx in _COUNT.items()}
    if not encoded or not decoded or not all(counts.values()):
        raise Incomplete("llama-speculative's timings are missing from its log")
    n = {name: int(m.group(1)) for name, m in counts.items()}
    n_gen, decode_s = int(decoded.group(1)), float(decoded.group(2))
    if n_gen != n["n_predict"]:
        raise FlexoffloadError(f"llama-speculative reports {n_gen} tokens decoded but n_predict = {n['n_predict']}")
    reported = float(decoded.group(3))
    # passes of the target after the first token: each ends with one token the target chose itself (a rejection
    # or the bonus token after a fully accepted draft), so passes = generated - accepted; the first token is free
    passes = n_gen - n["n_accept"] - 1
    return Speculative(
        text=stdout[len(head):-len(_TRAILER)], n_gen=n_gen, n_prompt=int(encoded.group(1)),
        encode_s=float(encoded.group(2)), decode_s=decode_s,
        decode_tok_s=(n_gen - 1) / decode_s if n_gen > 1 and decode_s > 0 else 0.0,
        reported_tok_s=reported if math.isfinite(reported) else 0.0,
        n_draft=n["n_draft"], n_drafted=n["n_drafted"], n_accept=n["n_accept"],
        acceptance_rate=n["n_accept"] / n["n_drafted"] if n["n_drafted"] else 0.0,
        tokens_per_pass=n_gen / passes if passes > 0 else 0.0, n_verify=max(passes, 0))


def command(target, draft, prompt: str, n_predict: int, n_ctx: int, n_batch: int, n_threads: int,
            n_draft: int, defaults: bool = False) -> list[str]:
    """The llama-speculative command line: greedy, both models mmap'd without repacking, one draft sequence
    (defaults: its own loading, repacked, as a user who passes no flag gets).

    The prompt goes in with -p and --no-escape (-f would drop its final newline, escapes would rewrite its
    backslashes). llama-speculative decodes the whole prompt as one logical batch, so -b is the context size;
    the physical batch -ub, which sizes the compute buffers, is n_batch, as flexoffload's -b.
    """
    return [str(tool("llama-speculative")), "-m", str(target), "-md", str(draft), "-p", prompt, "--no-escape",
            "-n", str(n_predict), "-c", str(n_ctx), "-b", str(n_ctx), "-ub", str(n_batch), "-t", str(n_threads),
            "--temp", "0", "-np", "1", "--spec-draft-n-max", str(n_draft), "--spec-draft-n-min", "0",
            "--color", "off", "--log-colors", "off"] + ([] if defaults else ["-lm", "mmap", "--no-repack"])


def run(target, draft, prompt: str, n_predict: int, n_ctx: int, n_batch: int, n_threads: int, n_draft: int,
        budget: int | None = None, timeout: float | None = None, cold: bool = True,
        defaults: bool = False) -> Speculative:
    """llama-speculative on the prompt, in its own memory cgroup at budget bytes (none: unlimited).

    cold: drop the page cache first (where permitted). A run the kernel stopped at the budget, a failure, a
    timeout or an output cut short is a FlexoffloadError.
    """
    if n_draft < 1:
        raise FlexoffloadError("--spec-draft-n-max must be at least 1")
    cmd = command(target, draft, prompt, n_predict, n_ctx, n_batch, n_threads, n_draft, defaults)
    if cold:
        budgets.drop_page_cache()
    r = budgets.run_limited(cmd, budget, timeout)
    if r.oom_killed:
        raise FlexoffloadError(f"out of memory: the kernel stopped llama-speculative at the enforced budget of "
                               f"{format_size(budget)}")
    if r.returncode != 0:
        last = [line for line in r.stderr.strip().splitlines() if line.strip()][-1:] or [f"exit {r.returncode}"]
        raise FlexoffloadError(f"llama-speculative failed (exit {r.returncode}): {last[0].strip()}")
    result = parse(r.stdout, r.stderr, prompt)
    result.peak_mem_mb, result.enforced, result.wall_s = r.peak_mem_mb, r.enforced, r.wall_s
    return result
