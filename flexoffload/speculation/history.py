"""Speculation's history: what runs of one target and draft measured (speccontrol.Measured), by prompt kind, kept
between runs as Token Recycling keeps its table, so the next run starts from it and decides its memory by it.

One JSON file a model pair, named by both files' keys (`path`): {"pair": its name, "kinds": {kind: Measured}}. A file
that is truncated, from another pair or otherwise unreadable is ignored with a note (`load`), never a crash, and
replaced whole by the next `save` (written aside, then renamed: a stopped run leaves the old one).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from flexoffload.speculation.control import Measured

CODE_MARKS = ("def ", "class ", "import ", "return", "{", "}", ";", "()", "    ", "\t", "=")


def kind(prompt: str) -> str:
    """A prompt's kind, as the history keeps acceptance apart: "code" where most lines look like code (an indent,
    a keyword, brackets), else "text"."""
    lines = [line for line in prompt.splitlines() if line.strip()]
    if not lines:
        return "text"
    code = sum(1 for line in lines if any(mark in line for mark in CODE_MARKS))
    return "code" if code * 2 >= len(lines) else "text"


def path(directory: Path, target_key: str, draft_key: str) -> Path:
    """Where the history of this target and draft (their files' keys) is kept."""
    return directory / f"{target_key}-{draft_key}.json"


def load(path: str | Path, prompt_kind: str, notes: list[str]) -> dict | None:
    """The stored measurements for this pair and kind (Measured.to_json's form), None where there are none; a file
    that cannot be read as this pair's history is ignored, and notes say so."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("pair") != path.stem:
            raise ValueError("it is not this model pair's")
        stored = data["kinds"].get(prompt_kind)
        if stored is None:
            return None
        Measured.from_json(stored)  # checked here, so that the run can trust it
        return stored
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        notes.append(f"flexoffload: ignoring the speculation history {path} ({e}): starting from the prior")
        return None


def save(path: str | Path, prompt_kind: str, measured: Measured) -> None:
    """Store a run's measurements under its kind, keeping the other kinds of this pair's readable file."""
    path = Path(path)
    data = {"pair": path.stem, "kinds": {}}
    try:
        old = json.loads(path.read_text())
        if isinstance(old, dict) and old.get("pair") == path.stem and isinstance(old.get("kinds"), dict):
            data["kinds"] = old["kinds"]
    except (OSError, ValueError):
        pass
    data["kinds"][prompt_kind] = measured.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
