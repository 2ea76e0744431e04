"""Lazy registry of attention backends: built-ins by module path, plugins by entry point.

Nothing is imported until a backend is asked for, so a missing optional kernel (Triton,
IPEX, a SYCL plugin) never breaks `import tpserve`.
"""

from __future__ import annotations

import importlib
import logging
from importlib.metadata import entry_points

import torch

from tpserve.errors import KernelUnavailableError
from tpserve.kernels.base import AttentionBackend, AttentionSpec

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tpserve.kernels"

# Preference order for --kernel auto: the fastest that supports the device comes first.
BUILTIN: dict[str, str] = {
    "ipex": "tpserve.kernels.ipex_backend:IpexAttentionBackend",
    "triton": "tpserve.kernels.triton_backend:TritonAttentionBackend",
    "torch": "tpserve.kernels.torch_backend:TorchAttentionBackend",
}


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_names() -> list[str]:
    return list(BUILTIN) + [n for n in _plugins() if n not in BUILTIN]


def origin(name: str) -> str:
    """Where a backend comes from: "built-in" or the plugin's entry point."""
    if name in BUILTIN:
        return "built-in"
    ep = _plugins().get(name)
    return f"plugin {ep.value}" if ep is not None else "unknown"


def load_backend_class(name: str) -> type[AttentionBackend]:
    """Import one backend class; raises KernelUnavailableError naming what failed."""
    try:
        if name in BUILTIN:
            module, _, attr = BUILTIN[name].partition(":")
            cls = getattr(importlib.import_module(module), attr)
        else:
            plugins = _plugins()
            if name not in plugins:
                raise KernelUnavailableError(
                    f"unknown attention backend {name!r}; known: {', '.join(available_names())}"
                )
            cls = plugins[name].load()
    except KernelUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001 - an optional kernel failing to import is a reason
        raise KernelUnavailableError(f"{name}: cannot import ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(cls, type) and issubclass(cls, AttentionBackend)):
        raise KernelUnavailableError(f"{name}: {cls!r} is not an AttentionBackend subclass")
    return cls


def why_not(name: str, device: torch.device, dtype: torch.dtype, spec: AttentionSpec) -> str | None:
    try:
        return load_backend_class(name).supports(device, dtype, spec)
    except KernelUnavailableError as exc:
        return str(exc)


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
