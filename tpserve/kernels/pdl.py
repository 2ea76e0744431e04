"""Programmatic dependent launch (PDL): whether the Triton kernels of a step launch with it.

A decode step of one sequence is a chain of short kernels (norm, GEMV, rotary, attention,
...), and each one's launch, ramp-up and drain used to sit between the previous kernel's
last store and the next kernel's first load. With PDL (CUDA, compute capability 9.0+) a
kernel is launched while its predecessor still runs: it signals at once that its own
successor may launch (`gdc_launch_dependents`) and waits for its predecessor's results
(`gdc_wait`) before it reads or writes anything a kernel writes; the GEMV issues its first
weight loads (constant during serving) before it waits, so they overlap the previous kernel.
Every PDL kernel waits before it finishes, so "kernel n finished" still implies that every
kernel before it did. Inside a CUDA graph the launches become programmatic edges.

On other devices (the CPU interpreter, XPU, older GPUs) the kernels compile without the
instructions and launch as before. TPSERVE_PDL=0 turns it off (A/B measurements).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

_DISABLED = os.environ.get("TPSERVE_PDL") == "0"  # read once: checked per launch


@functools.cache
def enabled(device: torch.device) -> bool:
    """True when launches on `device` use PDL (CUDA 9.0+ with a Triton that has it)."""
    if _DISABLED or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False
    # Launches with the PDL attribute inside graph capture need CUDA 12.3 or later.
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    if cuda < (12, 3):
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


# Rows (tokens, sequences) up to which a launch uses PDL. A single-sequence decode step gains
# 0.4 ms on the H200 (4.70 -> 4.29 ms); at 256 rows the served burst was 2% slower with it
# (early-launched kernels hold SM slots while the GEMMs before them finish), so large
# launches keep the plain launch.
MAX_ROWS = 8
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}


def launch(device: torch.device, rows: int = 1) -> dict:
    """The launch keywords of a PDL-capable kernel over `rows` rows on `device`: its PDL
    constexpr, and Triton's launch option where used. A model compiles both variants during
    warmup (its one-row and its largest decode batches)."""
    return _ON if rows <= MAX_ROWS and enabled(device) else _OFF
