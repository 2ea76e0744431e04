"""Lazy registry of attention backends: built-ins by module path, plugins by entry point.

Nothing is imported until a backend is asked for, so a missing optional kernel (Triton,
IPEX, a SYCL plugin) never breaks `import tpserve`.
"""

from __future__ import annotations

import logging

import torch

from tpserve.errors import KernelUnavailableError
from tpserve.kernels.base import AttentionBackend, AttentionSpec
from tpserve.kernels.kv_quant import fp8_refusal
from tpserve.kernels.lazy_classes import LazyClasses

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tpserve.kernels"

# Preference order for --kernel auto: the fastest that supports the device comes first.
BUILTIN: dict[str, str] = {
    "ipex": "tpserve.kernels.ipex_backend:IpexAttentionBackend",
    "triton": "tpserve.kernels.triton_backend:TritonAttentionBackend",
    "torch": "tpserve.kernels.torch_backend:TorchAttentionBackend",
}


_CLASSES = LazyClasses("attention backend", ENTRY_POINT_GROUP, BUILTIN, AttentionBackend)


def available_names() -> list[str]:
    return _CLASSES.names()


def origin(name: str) -> str:
    """Where a backend comes from: "built-in" or the plugin's entry point."""
    return _CLASSES.origin(name)


def load_backend_class(name: str) -> type[AttentionBackend]:
    """Import one backend class; raises KernelUnavailableError naming what failed."""
    return _CLASSES.load(name)


def why_not(name: str, device: torch.device, dtype: torch.dtype, spec: AttentionSpec) -> str | None:
    try:
        cls = load_backend_class(name)
    except KernelUnavailableError as exc:
        return str(exc)
    # A backend (a plugin written before fp8 caches existed) must say it handles one: its
    # supports() alone might accept the spec and then write fp8 bytes as if they were floats.
    if spec.kv_cache_dtype != "auto" and not getattr(cls, "fp8_kv_cache", False):
        return fp8_refusal(name)
    return cls.supports(device, dtype, spec)


def select_backend(
    name: str, device: torch.device, dtype: torch.dtype, specs: list[AttentionSpec]
) -> tuple[AttentionBackend, dict[str, str]]:
    """The backend to use for every spec of a model, and why each other one was passed over."""
    names = available_names() if name == "auto" else [name]
    if name == "auto":
        # Plugins are opt-in by name; auto considers only the built-ins.
        names = list(BUILTIN)
    passed_over: dict[str, str] = {}
    for candidate in names:
        reason = None
        for spec in specs:
            reason = why_not(candidate, device, dtype, spec)
            if reason:
                break
        if reason is None:
            return load_backend_class(candidate)(), passed_over
        passed_over[candidate] = reason
    if name != "auto":
        raise KernelUnavailableError(f"attention backend {name!r} cannot run here: {passed_over[name]}")
    raise KernelUnavailableError("no attention backend can run here: " + "; ".join(
        f"{k}: {v}" for k, v in passed_over.items()))
