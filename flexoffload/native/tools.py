"""The one runner of llama.cpp's tools (llama-quantize, llama-imatrix, llama-perplexity, ...) from the native build.

A tool runs to its end with its output captured; a failure or a run that does not end in time is one line of
FlexoffloadError naming the tool and its last error line, so a caller's user sees why without the tool's log.
"""

from __future__ import annotations

from flexoffload import FlexoffloadError
from flexoffload.native import process, tool


def failure(name: str, r: process.CompletedProcess) -> FlexoffloadError:
    """The one-line error of a tool that ended with a non-zero exit: its last line saying error or failed (else its
    last line), cut to 200 characters."""
    lines = [x for x in (r.stderr + r.stdout).splitlines() if x.strip()]
    errors = [x for x in lines if "error" in x.lower() or "failed" in x.lower()]
    why = (errors or lines or [""])[-1]
    return FlexoffloadError(f"{name} failed (exit {r.returncode}): {why.strip()[:200]}")


def run(name: str, args: list[str], timeout: float, n_threads: int | None = None) -> process.CompletedProcess:
    """The tool's finished run (stdout and stderr as text), without a stdin; a one-line error on failure or when it
    does not end in timeout seconds.

    n_threads: given, `-t N` is passed after args (the tools that take -t; llama-quantize takes its threads as its
    last positional argument instead)."""
    cmd = [str(tool(name))] + args
    if n_threads is not None:
        cmd += ["-t", str(n_threads)]
    r = process.run(cmd, timeout, what=name, errors="replace")
    if r.returncode != 0:
        raise failure(name, r)
    return r


def commit(where: str | None = None) -> str:
    """The git commit of the checkout at `where` (default: this package's), short, with "+" where its tracked
    files have changes; "" outside a checkout. Benchmarks record it beside the native build's key."""
    from pathlib import Path

    cwd = where or str(Path(__file__).resolve().parent.parent.parent)
    try:
        head = process.run(["git", "rev-parse", "--short=9", "HEAD"], 30, cwd=cwd)
        dirty = process.run(["git", "diff", "--quiet", "HEAD"], 30, cwd=cwd)
    except (OSError, process.TimeoutExpired):
        return ""
    if head.returncode != 0:
        return ""
    return head.stdout.strip() + ("+" if dirty.returncode == 1 else "")
