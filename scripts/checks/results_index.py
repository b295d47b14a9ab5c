#!/usr/bin/env python3
"""Every file under results/ is named in docs/results.md, the index (tests/test_results_index.py runs it).

    scripts/checks/results_index.py [--results DIR] [--index FILE]

Without an unnamed file it prints `results index: all N files named` and exits 0; otherwise it prints
`results index: K of N files not named in INDEX`, then each such file's path relative to the results folder, one a
line, and exits 1. It does not run anything else and reads only the two paths (defaults: the repository's
results/ and docs/results.md).

A file (its path relative to the results folder, e.g. `matrix.csv` or `m2cache_spec/llmcad_own.md`) counts as named
when one of these holds:

1. its path appears in the index as a whole name: not inside a longer one (`matrix.csv` is not named by
   `matrix_large.csv`), after a `/` only where that is `results/` (so `m2cache_spec/llmcad_own.csv` does not name a
   top-level `llmcad_own.csv`);
2. it is a sibling: a bullet of the index (a line starting with `- ` and the indented lines under it) links a file
   with the same stem (a Markdown link to `results/STEM.other`) and holds the bare extension in backticks, as in
   "[`serve.csv`](../results/serve.csv) (`.md`, `.png`)";
3. it matches a glob written in backticks that has a `*`, `?` or `[` in it and no space (`llmcad_*.jsonl`; a
   leading `results/` or `../results/` is dropped; fnmatch's `*` matches across `/` too, so keep globs narrow).

Named files that do not exist are not an error: the index may describe a file a command will write.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
NAME = r"[\w.\-]"  # a character a file name goes on with


def bullets(text: str) -> list[str]:
    """The index's bullets: each a line starting with "- " and the indented lines after it, up to a blank line, a
    heading or the next bullet."""
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("- "):
            current = [line]
            out.append(current)
        elif current is not None and line.startswith(" ") and line.strip():
            current.append(line)
        else:
            current = None
    return ["\n".join(b) for b in out]


def backticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def strip_results(path: str) -> str:
    return re.sub(r"^(\.\./)?results/", "", path)


def by_path(rel: str, text: str) -> bool:
    """Rule 1: the path as a whole name, after `results/` or a character that is no part of a path."""
    pattern = rf"(?:(?<![\w.\-/])|(?<=results/)){re.escape(rel)}(?!{NAME})"
    return re.search(pattern, text) is not None


def siblings(text: str) -> set[str]:
    """Rule 2: STEM.ext for each bullet linking results/STEM.other and holding "`.ext`"."""
    out = set()
    for bullet in bullets(text):
        stems = {strip_results(target).rsplit(".", 1)[0]
                 for target in re.findall(r"\]\(((?:\.\./)?results/[^)\s]+)\)", bullet) if "." in target}
        exts = {t for t in backticked(bullet) if re.fullmatch(r"\.\w+", t)}
        out |= {stem + ext for stem in stems for ext in exts}
    return out


def globs(text: str) -> list[str]:
    """Rule 3: the backticked globs."""
    return [strip_results(t) for t in backticked(text) if re.search(r"[*?\[]", t) and " " not in t]


def unnamed(results: Path, index: Path) -> tuple[list[str], int]:
    """The files under results not named in index (sorted), and how many files there are."""
    text = index.read_text()
    files = sorted(p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file())
    named_siblings, patterns = siblings(text), globs(text)
    missing = [rel for rel in files
               if not (by_path(rel, text) or rel in named_siblings
                       or any(fnmatch.fnmatchcase(rel, g) for g in patterns))]
    return missing, len(files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=REPO / "results", help="the results folder (default: %(default)s)")
    ap.add_argument("--index", type=Path, default=REPO / "docs" / "results.md", help="the index (default: %(default)s)")
    args = ap.parse_args(argv)
    if not args.results.is_dir() or not args.index.is_file():
        print(f"results index: no folder {args.results} or no index {args.index}", file=sys.stderr)
        return 2
    missing, n = unnamed(args.results, args.index)
    if not missing:
        print(f"results index: all {n} files named")
        return 0
    print(f"results index: {len(missing)} of {n} files not named in {args.index}")
    for rel in missing:
        print(rel)
    return 1


if __name__ == "__main__":
    sys.exit(main())
