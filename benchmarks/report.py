"""How a benchmark hands over its table: printed, and appended to --out when given."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


def cuda_args(doc: str, name: str):
    """--out and --reps, parsed; None (after saying so) where there is no CUDA GPU, for
    the benchmarks that time CUDA graphs."""
    import argparse
    import sys

    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA GPU", file=sys.stderr)
        return None
    return args


def graph_us(step, calls: int, reps: int) -> float:
    """Microseconds per call of `step`, a function making `calls` launches: run once on a
    side stream (warm: compile, or tune under TunableOp), captured in one CUDA graph, and
    that graph replayed `reps` times between two events."""
    import torch

    from tpserve.kernels.gemv import capture

    g, _ = capture(step)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / (reps * calls)
