#!/usr/bin/env python3
"""The read pool before and after patch 0011 (huge pages): decode tok/s and the disk's request sizes, in turn.

Each run is `flexoffload run --mem MEM --enforce` (a fresh process in a cgroup at the budget, page cache dropped),
on the native build given by --before (one built without patch 0011: its pool is 4 KiB pages, populated by
MAP_POPULATE) or on this checkout's. The block device's counters (/sys/dev/block/M:m/stat) give the read requests
each run made and their mean size. --fragment N first leaves N GiB of free memory in single scattered 4 KiB pages
(a helper maps 2N GiB, touches it and gives back every other page, held until the end), as a long-running machine's
free memory is: the allocator serves single pages from those first. Needs root.

    scripts/checks/compare_pool.py --before ~/.cache/flexoffload/native/KEY/build/bin --mem 0.4x -r 3 \
        -o results/pool_qwen1.5b_04x.csv
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from flexoffload.memory import budgets
from flexoffload.gguf import catalog
from flexoffload.bench.sweep import write_csv


# maps 2N GiB, touches every page, gives every other one back, says so and holds the rest until stdin closes
FRAGMENT = """
import mmap, sys
n = int(sys.argv[1]) << 31
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
m.madvise(mmap.MADV_NOHUGEPAGE)
for off in range(0, n, mmap.PAGESIZE):
    m[off] = 1
for off in range(0, n, 2 * mmap.PAGESIZE):
    m.madvise(mmap.MADV_DONTNEED, off, mmap.PAGESIZE)
print("ready", flush=True)
sys.stdin.read()
"""


def device_reads(path: str) -> tuple[int, int]:
    """(read requests completed, sectors read) so far on the block device holding path."""
    st = os.stat(path)
    fields = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat").read_text().split()
    return int(fields[0]), int(fields[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="bin/ of a native build without patch 0011")
    ap.add_argument("-m", "--model", default=catalog.DEFAULT_MODEL)
    ap.add_argument("--mem", default="0.4x")
    ap.add_argument("--policies", default="balanced,ffn-first")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=24)
    ap.add_argument("--fragment", type=int, default=0, metavar="GIB", help="scatter this much free memory first")
    ap.add_argument("-o", "--output", required=True)
    a = ap.parse_args()
    path = str(catalog.resolve(a.model))
    rows = []
    helper = None
    if a.fragment:
        helper = subprocess.Popen([sys.executable, "-c", FRAGMENT, str(a.fragment)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert helper.stdout.readline().strip() == "ready"
    for rep in range(a.repetitions):
        for pool, native in (("4k", a.before), ("huge", None)):
            env = {**os.environ, "FLEXOFFLOAD_NATIVE": native} if native else {
                k: v for k, v in os.environ.items() if k != "FLEXOFFLOAD_NATIVE"}
            for policy in a.policies.split(","):
                budgets.drop_page_cache()
                ios0, sectors0 = device_reads(path)
                out = subprocess.run(
                    [sys.executable, "-m", "flexoffload", "run", "-m", path, "--mem", a.mem, "--enforce",
                     "--policy", policy, "-n", str(a.n_predict), "--temp", "0", "-p", "def quicksort(arr):", "--json"],
                    capture_output=True, text=True, check=True, env=env).stdout
                ios1, sectors1 = device_reads(path)
                r = json.loads(out)
                row = {"model": Path(path).name, "budget": a.mem, "fragmented_gib": a.fragment, "policy": policy,
                       "pool": pool, "rep": rep + 1,
                       "tok_s": r["decode_tok_s"], "read_requests": ios1 - ios0,
                       "mean_request_kib": (sectors1 - sectors0) * 512 / 1024 / max(ios1 - ios0, 1),
                       "peak_mb": r["peak_mem_mb"]}
                rows.append(row)
                print(f"{policy:>12} pool={pool:<4} {row['tok_s']:.2f} tok/s, {row['read_requests']} requests of "
                      f"{row['mean_request_kib']:.0f} KiB, peak {row['peak_mb']:.0f} MiB", flush=True)
    if helper:
        helper.communicate("")
    write_csv(rows, a.output)


if __name__ == "__main__":
    main()
