#!/usr/bin/env python3
"""How fast this machine gives a process memory it has not touched: anonymous huge pages (MADV_HUGEPAGE) of a 2 GiB
mapping touched one byte per 2 MiB, unmapped, mapped again; rounds back to back (the kernel reuses the pages just
freed) and with a pause between them (freed memory may go back to the host, as a VM's free page reporting does).
Why: a MoE's expert slots are filled by a prompt, and the first touch of the memory they take costs CPU the prompt
computes on (docs/moe.md, "The prompt").

    scripts/checks/fresh_pages.py [-r 4] [--pauses 0,10] -o results/fresh_pages.csv
"""

import argparse
import csv
import mmap
import time

SIZE = 2 << 30
HUGE = 2 << 20


def touch() -> float:
    """Seconds to fault in SIZE bytes of a fresh anonymous mapping."""
    m = mmap.mmap(-1, SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    t = time.perf_counter()
    for off in range(0, SIZE, HUGE):
        m[off] = 1
    seconds = time.perf_counter() - t
    m.close()
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-r", "--rounds", type=int, default=4)
    ap.add_argument("--pauses", default="0,10", help="seconds between rounds, a comma list: a set of rounds each")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    with open(a.out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["pause_s", "round", "seconds", "gb_s"])
        for pause in (float(x) for x in a.pauses.split(",")):
            for i in range(a.rounds):
                s = touch()
                w.writerow([pause, i, round(s, 3), round(SIZE / s / 1e9, 2)])
                print(f"pause {pause:g} s, round {i}: {SIZE / s / 1e9:.2f} GB/s ({s:.2f} s)", flush=True)
                time.sleep(pause)


if __name__ == "__main__":
    main()
