"""Where a launch's time goes. Each process on the node notes wall-clock marks (the end of a
phase) as it starts; the launcher turns them into one line of phases, so a slow start says
which part was slow (Ray, the shard process, imports, weights, warmup) instead of one total.
Pure Python: the driver and the shard processes share the node's clock."""

from __future__ import annotations

import os
import time

Mark = tuple[str, "float | None"]


def process_started_at() -> float | None:
    """Wall-clock start of this process (Linux /proc), so the time a shard process took to
    come up (Ray scheduling, spawn) is told apart from its imports; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def phases(start: float, marks: list[Mark]) -> list[tuple[str, float]]:
    """(phase, seconds) from marks in order, each the wall time its phase ended; a phase
    whose mark is missing (None) is folded into the next one."""
    out, last = [], start
    for name, at in marks:
        if at is None:
            continue
        out.append((name, max(0.0, at - last)))
        last = max(last, at)
    return out


# Rank 0's phases in the order they run, each with the mark that ends it. "shard process" is
# Ray placing the actor and spawning its process; "imports" its Python start-up (Ray, torch,
# tpserve); "config" reading the checkpoint's config (a snapshot from the launcher, or
# transformers); "set-up call" the wait for the driver's prepare call; then the set-up itself;
# "waiting for the driver" the wait for its start call, which comes once the driver has
# loaded the tokenizer (the set-up runs meanwhile); "step loop" starting the loop.
SHARD_PHASES = (("shard process", "process"), ("imports", "init"), ("config", "config"),
                ("set-up call", "prepare"), ("device", "device"), ("weights", "weights"),
                ("KV cache", "cache"), ("kernel warmup", "kernels"), ("graphs", "graphs"),
                ("waiting for the driver", "start"), ("step loop", "loop"))


def shard_startup(placed: float, marks: dict[str, float | None]) -> list[tuple[str, float]]:
    """Rank 0's phases from the moment its actor was requested (placed)."""
    return phases(placed, [(name, marks.get(key)) for name, key in SHARD_PHASES])


def describe(split: list[tuple[str, float]]) -> str:
    return ", ".join(f"{name} {seconds:.1f}s" for name, seconds in split)


def now() -> float:
    return time.time()
