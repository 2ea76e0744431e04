"""A timeline of the engine core's steps and admissions, for finding where a served burst's
time goes (benchmarks/serve_bench.py reads it with its step-trace option; see
docs/troubleshooting.md).

Off unless TPSERVE_STEP_TRACE names a file. Then the step loop appends one JSON line per
step and per batch of admitted requests, stamped with the wall clock (time.time(), so a client on
the same host can line its own times up with them), buffered in memory and written whenever
the core goes idle, so tracing adds no file write to a step.

    {"kind": "add", "t": 1764672000.12, "n": 16}
    {"kind": "step", "t": ..., "dt": 0.0113, "wait": 0.0091, "tokens": 256, "prefill": 0,
     "out": 256}

dt: seconds inside EngineCore.step() (launch of this step and collection of the one before);
wait: the part of it waiting for the device; tokens: tokens the launched step computes;
prefill: 1 when it prefilled something; out: tokens collected (sampled) in it.
"""

from __future__ import annotations

import json
import os
import time

ENV = "TPSERVE_STEP_TRACE"
FLUSH_ROWS = 65536  # bounds memory on a server that never goes idle


class StepTrace:
    def __init__(self, path: str) -> None:
        self.path = path
        self.rows: list[dict] = []

    @classmethod
    def from_env(cls, suffix: str = "") -> StepTrace | None:
        """The trace named by TPSERVE_STEP_TRACE (plus `suffix`: the driver writes its own
        file next to the core's), or None when it is not set."""
        path = os.environ.get(ENV)
        return cls(path + suffix) if path else None

    def event(self, kind: str, n: int) -> None:
        """n things of `kind` now: "add" (requests admitted by the core); in the driver's
        file "arrive" (a request reached the engine), "submit" (a batch sent to the core),
        "events" (tokens handed to the HTTP handlers), "done" (requests finished)."""
        self.rows.append({"kind": kind, "t": time.time(), "n": n})

    def step(self, t0: float, dt: float, before: dict[str, float], after: dict[str, float],
             outputs: int) -> None:
        """t0: wall time the step began; before, after: EngineCore.counters() around it."""
        self.rows.append({
            "kind": "step", "t": t0, "dt": dt,
            "wait": after["step_device_wait_seconds"] - before["step_device_wait_seconds"],
            "tokens": int(after["step_tokens"] - before["step_tokens"]),
            "prefill": int(after["prefill_steps"] - before["prefill_steps"]),
            "out": outputs})
        if len(self.rows) >= FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        rows, self.rows = self.rows, []  # other threads append to the new list meanwhile
        if rows:
            with open(self.path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


def read(path: str, since: float = float("-inf")) -> list[dict]:
    """The trace's rows stamped at or after `since` (wall clock)."""
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
    return [r for r in rows if r["t"] >= since]
