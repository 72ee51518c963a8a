"""Median microseconds since the sender's submit of every traced step (``sitecustomize.py``), in
the sender (S) and the receiver (R), for one transfer at a time.

    python bench/trace/show.py DIR [--skip N]     (N: the first transfers left out, 100 by default)
"""

from __future__ import annotations

import argparse
import bisect
import glob
import json
import os
import statistics


def table(folder: str, skip: int = 100) -> list[tuple[float, str, str, int, int]]:
    """(median µs, side, step, its occurrence in the transfer, transfers seen), by median."""
    processes = {}
    for path in glob.glob(os.path.join(folder, "*.json")):
        with open(path) as f:
            processes[path] = json.load(f)
    sender = next((p for p, events in processes.items() if any(step == "leased" for step, _ in events)), None)
    if sender is None:
        raise SystemExit(f"no sidecar in {folder} made a leased write (is bench/trace first on PYTHONPATH?)")
    starts = [at for step, at in processes[sender] if step == "submit"]
    since: dict[tuple[str, str, int], list[float]] = {}
    for path, events in processes.items():
        side = "S" if path == sender else "R"
        seen: dict[tuple[int, str], int] = {}
        for step, at in events:
            i = bisect.bisect_right(starts, at) - 1
            if i < skip or i + 1 >= len(starts):
                continue  # warming up, or the last transfer (its end is not bounded by a next submit)
            nth = seen.get((i, step), 0)
            seen[(i, step)] = nth + 1
            since.setdefault((side, step, nth), []).append((at - starts[i]) / 1e3)
    rows = [(statistics.median(v), side, step, nth, len(v)) for (side, step, nth), v in since.items()]
    return sorted(row for row in rows if row[4] >= (len(starts) - skip) // 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder")
    parser.add_argument("--skip", type=int, default=100)
    args = parser.parse_args()
    print("| µs since submit | side | step | transfers |\n|---:|---|---|---:|")
    for median, side, step, nth, n in table(args.folder, args.skip):
        print(f"| {median:.1f} | {side} | {step}{f' ({nth + 1})' if nth else ''} | {n} |")


if __name__ == "__main__":
    main()
