"""scripts/checks/import_circles.py, the circle check of `make test`: it finds a circle closed inside a function, and
the package has none."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "checks" / "import_circles.py"


def check(package: Path) -> subprocess.CompletedProcess:
    """The script's run on a package directory."""
    return subprocess.run([sys.executable, str(SCRIPT), str(package)], capture_output=True, text=True, timeout=60)


def write(root: Path, files: dict[str, str]) -> Path:
    """A package of these files (relative path: text) under root; its directory."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


def test_a_circle_closed_inside_a_function_is_found(tmp_path):
    package = write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import two\n\n\ndef one():\n    return two()\n",
        # b imports a back, inside a function: no error at load time, a circle all the same
        "pkg/b.py": "def two():\n    from pkg import a\n\n    return a\n",
        "pkg/c.py": "from . import a\n",  # imports a without being imported back: in no circle
    })
    r = check(package)
    assert r.returncode == 1
    assert r.stdout.splitlines() == ["import circles: 1", "pkg.a <-> pkg.b"]


def test_a_registry_in_the_init_is_no_circle_but_a_helper_taken_back_from_it_is(tmp_path):
    """An __init__ that imports its modules to list them, and the modules importing a sibling module: no circle. A
    module taking a name defined in the __init__ that imports it: a circle."""
    package = write(tmp_path, {
        "pkg/__init__.py": "from pkg import first, second\n\nPOLICIES = [first.run, second.run]\n",
        "pkg/first.py": "from pkg import second\n\n\ndef run():\n    return second.run()\n",
        "pkg/second.py": "def run():\n    return 2\n",
    })
    r = check(package)
    assert r.returncode == 0 and r.stdout.strip() == "import circles: none (3 modules, 3 imports)"
    (package / "second.py").write_text("def run():\n    from pkg import POLICIES\n\n    return len(POLICIES)\n")
    r = check(package)
    assert r.returncode == 1 and "pkg <-> pkg.first <-> pkg.second" in r.stdout.splitlines()


def test_the_package_has_no_import_circle():
    r = check(REPO / "flexoffload")
    assert r.returncode == 0, r.stdout
    assert r.stdout.startswith("import circles: none (")
