"""Where JIT-compiled kernels are kept between starts, which shapes warmup covers, and how
compilations are counted, so a test can prove that serving never compiles."""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path

TRITON_CACHE_ENV = "TRITON_CACHE_DIR"


def default_cache_root() -> Path:
    """~/.cache/tpserve (or $XDG_CACHE_HOME/tpserve): kernels compiled here survive restarts."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tpserve"


def configure_triton_cache() -> Path:
    """Point Triton's on-disk cache at ~/.cache/tpserve/triton unless the user chose one.
    Must run before triton is imported: Triton reads the variable when it first builds a
    cache manager, and a process that compiled elsewhere would miss the warm cache."""
    path = os.environ.get(TRITON_CACHE_ENV)
    if not path:
        path = str(default_cache_root() / "triton")
        os.environ[TRITON_CACHE_ENV] = path
    Path(path).mkdir(parents=True, exist_ok=True)
    return Path(path)


def cached_kernel_count(cache_dir: Path) -> int:
    """Kernels compiled into `cache_dir`: Triton writes one __grp__*.json per compilation and
    none when it loads a kernel from disk, so a growing count means a compile from source."""
    return len(glob.glob(os.path.join(str(cache_dir), "*", "__grp__*.json")))


def warmup_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch-size buckets a server with `max_num_seqs` warms up: powers of two and the
    maximum itself."""
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    sizes.append(max(1, max_num_seqs))
    return tuple(sizes)


def dynamo_compile_count() -> int:
    """Graphs torch.compile has built in this process (0 when nothing uses it)."""
    if "torch._dynamo" not in sys.modules:
        return 0  # nothing compiled; importing dynamo just to read 0 costs seconds
    try:
        from torch._dynamo.utils import counters
    except Exception:  # noqa: BLE001 - a torch without dynamo compiles nothing
        return 0
    return int(counters["stats"]["unique_graphs"])


def compile_count(backend) -> int:
    """Compilations attributable to `backend` so far: its own counter when it has one (the
    Triton backend counts kernel variants built in this process), else torch.compile's."""
    own = getattr(backend, "compile_count", None)
    if callable(own):
        return int(own())
    return dynamo_compile_count()


# Triton's backend name for each torch device type.
TRITON_TARGETS = {"cuda": "nvidia", "xpu": "intel"}


def triton_missing(device_type: str) -> str | None:
    """Why Triton cannot run kernels for this device type here, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    configure_triton_cache()
    try:
        import triton.backends
    except Exception as exc:  # noqa: BLE001 - a broken install is a reason, not a crash
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    target = TRITON_TARGETS.get(device_type)
    if target and target not in getattr(triton.backends, "backends", {target: None}):
        hint = " (install Intel's triton-xpu)" if device_type == "xpu" else ""
        return f"this triton has no {target} backend for {device_type}{hint}"
    return None
