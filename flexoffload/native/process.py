"""Every process flexoffload starts: `run` to its end, or `start` and hand back.

The one place that spawns (tests/test_processes.py holds the rest of the package to it), so how a child is started
(no stdin unless given, held before it execs while the parent places it, killed with its parent) is decided once.
What callers need of subprocess beside spawning (DEVNULL, PIPE, STDOUT, the Popen and CompletedProcess types,
TimeoutExpired) is re-exported here, so they do not import it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from subprocess import DEVNULL, PIPE, STDOUT, CompletedProcess, Popen, TimeoutExpired

from flexoffload import FlexoffloadError

__all__ = ["DEVNULL", "PIPE", "STDOUT", "CompletedProcess", "Popen", "TimeoutExpired", "run", "start"]


def run(cmd: list[str], timeout: float | None = None, what: str | None = None, **kwargs) -> CompletedProcess:
    """cmd run to its end: its output captured as text, without a stdin (kwargs: subprocess.run's, to say
    otherwise). A run that does not end in timeout seconds is killed; what given, that is one line of
    FlexoffloadError naming it ("WHAT did not end in N s"), else subprocess's TimeoutExpired. An exit status is
    left to the caller."""
    kwargs.setdefault("stdin", DEVNULL)
    if "stdout" not in kwargs and "stderr" not in kwargs:
        kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    try:
        return subprocess.run(cmd, timeout=timeout, **kwargs)
    except TimeoutExpired:
        if what is None:
            raise
        raise FlexoffloadError(f"{what} did not end in {timeout:.0f} s") from None


def _with_parent_death(cmd: list[str], signal_name: str) -> list[str]:
    """cmd sent signal_name when its parent dies (setpriv --pdeathsig, kept across exec), where setpriv is found;
    else cmd as it is."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", signal_name, "--", *cmd] if setpriv else list(cmd)


def start(cmd: list[str], *, pdeathsig: str | None = None, before_exec: Callable[[Popen], None] | None = None,
          **kwargs) -> Popen:
    """cmd started and handed back running (kwargs: subprocess.Popen's).

    pdeathsig: a signal's name (TERM) the child gets when this process dies, however it dies.
    before_exec(proc): called in this process once the child exists and before it execs cmd, so that what it does
    to the pid (moving it into a memory cgroup) holds from cmd's first instruction. Not with preexec_fn (unsafe in a
    process with threads): a shell starts first and waits on a pipe, before_exec runs, then the shell execs cmd.
    bash, not sh: the pipe's descriptor may be above 9, which POSIX sh redirections cannot name. Where before_exec
    raises, the child is killed and waited for, and the error raised."""
    if pdeathsig is not None:
        cmd = _with_parent_death(cmd, pdeathsig)
    if before_exec is None:
        return Popen(cmd, **kwargs)
    read_end, write_end = os.pipe()
    wait_then_exec = f'read -r -u {read_end} _; exec {read_end}<&-; exec "$@"'
    try:
        proc = Popen(["bash", "-c", wait_then_exec, "bash", *cmd], pass_fds=(read_end,), **kwargs)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)
    try:
        before_exec(proc)
    except BaseException:
        os.close(write_end)
        proc.kill()
        proc.wait()
        raise
    os.write(write_end, b"\n")
    os.close(write_end)
    return proc
