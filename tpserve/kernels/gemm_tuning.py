"""GEMM algorithms timed per decode batch bucket (PyTorch's TunableOp), CUDA and ROCm only.

Why: at 256 rows a decode step's weight GEMMs are compute-bound and take ~6.4 ms on one
H200, and the BLAS library's heuristic choice is not always the fastest algorithm for these
shapes (benchmarks/gemm_tuning.py measured TunableOp 4% faster at 256 rows). Tuning every
shape was slower at prefill sizes (4096 rows) and a tuning pass per new shape would stall
serving, so only the decode graphs' buckets of at least MIN_ROWS rows are tuned, in warmup
right before each bucket is captured; every other GEMM keeps the library's default (TunableOp
enabled with tuning off calls the default for a shape it has no result for). Results are kept
in the cache directory, one file per GPU model, torch build and rank, so a warm start tunes
nothing.

Off by default: TPSERVE_TUNE_GEMMS=1 turns it on. Measured on one H200 (docs/benchmarks.md,
"the burst's tail"), tuning took 0.9 s for 45 shapes and moved the decode step at 256 rows
by 0.7% (11.07 -> 10.99 ms) and a served 256-request burst by 0.4%: within run-to-run
spread, too little to make a prototype PyTorch feature every start's default.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from tpserve.kernels.compile_cache import default_cache_root

log = logging.getLogger(__name__)

ENV = "TPSERVE_TUNE_GEMMS"
MIN_ROWS = 64  # below this a decode GEMM reads weights at the copy bandwidth: nothing to gain
MAX_TUNING_MS = 10  # per candidate algorithm (TunableOp's default is 30)


def wanted(device: torch.device) -> bool:
    """Tuning applies: TPSERVE_TUNE_GEMMS=1 and a CUDA (or ROCm) device with TunableOp."""
    if os.environ.get(ENV, "0") != "1" or device.type != "cuda":
        return False
    return hasattr(torch.cuda, "tunable")


def results_file(device: torch.device, rank: int, root: Path | None = None) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", torch.cuda.get_device_name(device))
    torch_ver = re.sub(r"[^A-Za-z0-9_.-]+", "_", torch.__version__)
    return (root or default_cache_root()) / "tunableop" / f"{name}-torch{torch_ver}-rank{rank}.csv"


class GemmTuning:
    """Warmup's handle: start() before the graphs, tune(rows) around each bucket's eager
    forward, finish() after the last."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device, self.rank = device, rank
        self.on = False
        self.seconds = 0.0
        self.path: Path | None = None

    def start(self) -> bool:
        """Enable TunableOp with this process's results file; False (and serving goes on
        with the library's defaults) where it is off or this torch lacks what it needs."""
        if not wanted(self.device):
            return False
        try:
            self._start()
        except Exception as exc:  # noqa: BLE001 - an optional speed-up never stops a start
            log.warning("GEMM tuning is off: TunableOp could not start (%s: %s)",
                        type(exc).__name__, exc)
            self._disable()
            return False
        self.on = True
        return True

    def _start(self) -> None:
        tunable = torch.cuda.tunable
        self.path = results_file(self.device, self.rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tunable.set_filename(str(self.path))
        on_exit = getattr(tunable, "write_file_on_exit", None)  # not in every torch
        if on_exit is not None:
            on_exit(False)  # finish() writes; an actor may be killed instead of exiting
        tunable.set_max_tuning_duration(MAX_TUNING_MS)
        tunable.tuning_enable(False)
        tunable.enable(True)
        if self.path.exists():
            tunable.read_file(str(self.path))

    @staticmethod
    def _disable() -> None:
        try:
            torch.cuda.tunable.tuning_enable(False)
            torch.cuda.tunable.enable(False)
        except Exception:  # noqa: BLE001 - nothing was enabled
            pass

    @contextlib.contextmanager
    def tune(self, rows: int) -> Iterator[None]:
        """Tune the GEMMs run inside the block when it has at least MIN_ROWS rows (shapes
        already in the results file are not timed again)."""
        if not self.on or rows < MIN_ROWS:
            yield
            return
        t0 = time.perf_counter()
        torch.cuda.tunable.tuning_enable(True)
        try:
            yield
        finally:
            torch.cuda.tunable.tuning_enable(False)
            torch.cuda.synchronize(self.device)
            self.seconds += time.perf_counter() - t0

    def finish(self) -> None:
        if not self.on:
            return
        tunable = torch.cuda.tunable
        try:
            write_results(tunable, self.path)
        except Exception as exc:  # noqa: BLE001 - the next start tunes again, that is all
            log.warning("could not keep the GEMM tuning results in %s: %s", self.path, exc)
        log.info("GEMM tuning (TunableOp) for decode batches of %d+ rows: %.1fs, %d results "
                 "in %s", MIN_ROWS, self.seconds, len(tunable.get_results()), self.path)


def write_results(tunable, path: Path) -> None:
    """The results as TunableOp's own file (validators, then one line per tuned GEMM, the
    format read_file() reads), written now: torch writes it only when the process exits,
    and a shard actor is often killed instead; newer torch has no write_file() either."""
    lines = [f"Validator,{k},{v}" for k, v in tunable.get_validators()]
    lines += [",".join(str(f) for f in row) for row in tunable.get_results()]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
