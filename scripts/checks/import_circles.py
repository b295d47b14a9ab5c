#!/usr/bin/env python3
"""Import circles in a package, the imports inside functions counted too (`make test` runs it on flexoffload).

    scripts/checks/import_circles.py PACKAGE_DIR

lint-imports checks the layers between packages, but not modules of one layer importing each other, and it does not
see an import made inside a function to put off a circle at load time: the circle is still there for a reader.
Every `import` and `from ... import` statement of every module is read (module level, functions, branches), and
each set of modules that reach each other through them is printed, one a line (`a <-> b <-> c`), with exit
status 1; without any it prints `import circles: none (N modules, M imports)` and exits 0.

`from package import module` is an import of that module, as `import package.module` is, not of the package's
__init__ (an __init__ that imports its modules to list them is no circle with a module importing a sibling);
`from package import name` of anything else is an import of the __init__.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Every module of the package at root by dotted name (the package's own name first): its file, and whether it
    is a package's __init__."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        parts = list(f.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (f, is_package)
    return out


def imports(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Each module's imports of the package's other modules, wherever in the file the statement is."""
    graph = {m: set() for m in mods}
    for m, (f, is_package) in mods.items():
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per dot beyond the first
                    package = m.split(".") if is_package else m.split(".")[:-1]
                    package = package[:len(package) - node.level + 1]
                    base = ".".join(package + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in mods and n != m}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm), each sorted, in name order."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * len(graph) + 100))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:  # v is the root of a strongly connected set: pop it
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                out.append(sorted(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str]) -> int:
    """Print the package's import circles and return 1, or a line saying there are none and return 0."""
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    graph = imports(modules(Path(argv[0]).resolve()))
    found = circles(graph)
    if not found:
        print(f"import circles: none ({len(graph)} modules, {sum(len(g) for g in graph.values())} imports)")
        return 0
    print(f"import circles: {len(found)}")
    for members in found:
        print(" <-> ".join(members))
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
