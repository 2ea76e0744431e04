"""Summarise py-spy raw profiles (`--format raw --threads`, as serve_bench --py-spy records
them): for each thread, its seconds of samples, then the functions most of them were in
(inclusive) and the frames they were at (self). With a `--gil` profile the seconds are the
time that thread held the GIL.

    python benchmarks/spy_summary.py FILE [FILE ...] [--rate 500] [--top 15]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

LINE = re.compile(r" \(([^()]*):\d+\)$")  # " (file.py:123)" at the end of a frame


def frame_name(frame: str) -> str:
    """`func (path/file.py:123)` -> `func (file.py)`: lines of one function count together."""
    m = LINE.search(frame)
    return frame if m is None else f"{frame[:m.start()]} ({Path(m.group(1)).name})"


def summarise(path: Path, rate: float, top: int) -> str:
    per_thread: dict[str, Counter] = defaultdict(Counter)
    leaves: dict[str, Counter] = defaultdict(Counter)
    totals: Counter = Counter()
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # "thread (tid): name" is the root frame when --threads was given.
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        n = int(count)
        totals[thread] += n
        names = [frame_name(f) for f in frames[1:]]
        for name in set(names):
            per_thread[thread][name] += n
        leaves[thread][names[-1] if names else "(no frame)"] += n
    out = [f"## {path.name}: {sum(totals.values()) / rate:.2f} s of samples"]
    for thread, n in totals.most_common():
        out.append(f"\n### thread {thread}: {n / rate:.2f} s")
        out.append("inclusive:")
        out += [f"  {c / rate:8.3f} s  {name}" for name, c in per_thread[thread].most_common(top)]
        out.append("self:")
        out += [f"  {c / rate:8.3f} s  {name}" for name, c in leaves[thread].most_common(top)]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+")
    ap.add_argument("--rate", type=float, default=500, help="py-spy's --rate (samples/s)")
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    for f in args.files:
        print(summarise(f, args.rate, args.top), "\n")


if __name__ == "__main__":
    main()
