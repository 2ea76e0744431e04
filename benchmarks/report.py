"""How a benchmark hands over its table: printed, and appended to --out when given."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: Path | None) -> None:
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "a") as f:
            f.write(text + "\n")


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
