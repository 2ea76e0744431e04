"""Lazy registry of quantized-matmul kernels, mirroring the attention registry: built-ins by
module path, plugins (an IPEX or SYCL int4 GEMM) by entry point in group
`tpserve.quant_kernels`. Nothing is imported until asked for, so a missing Triton never breaks
`import tpserve`."""

from __future__ import annotations

import functools
import importlib
import logging
from importlib.metadata import entry_points

import torch

from tpserve.errors import KernelUnavailableError
from tpserve.kernels.quant.base import QuantKernel

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tpserve.quant_kernels"

# Preference order for auto: the fastest that supports the device comes first.
BUILTIN: dict[str, str] = {
    "triton": "tpserve.kernels.quant.triton_kernel:TritonQuantKernel",
    "torch": "tpserve.kernels.quant.torch_ref:TorchQuantKernel",
}


def _plugins() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_names() -> list[str]:
    return list(BUILTIN) + [n for n in _plugins() if n not in BUILTIN]


def load_kernel_class(name: str) -> type[QuantKernel]:
    """Import one kernel class; raises KernelUnavailableError naming what failed."""
    try:
        if name in BUILTIN:
            module, _, attr = BUILTIN[name].partition(":")
            cls = getattr(importlib.import_module(module), attr)
        else:
            plugins = _plugins()
            if name not in plugins:
                raise KernelUnavailableError(
                    f"unknown quantized-matmul kernel {name!r}; known: "
                    f"{', '.join(available_names())}")
            cls = plugins[name].load()
    except KernelUnavailableError:
        raise
    except Exception as exc:  # noqa: BLE001 - an optional kernel failing to import is a reason
        raise KernelUnavailableError(f"{name}: cannot import ({type(exc).__name__}: {exc})") from exc
    if not (isinstance(cls, type) and issubclass(cls, QuantKernel)):
        raise KernelUnavailableError(f"{name}: {cls!r} is not a QuantKernel subclass")
    return cls


def why_not(name: str, device: torch.device, dtype: torch.dtype, method: str) -> str | None:
    try:
        return load_kernel_class(name).supports(device, dtype, method)
    except KernelUnavailableError as exc:
        return str(exc)


@functools.cache
def select_quant_kernel(name: str, device: torch.device, dtype: torch.dtype,
                        method: str) -> QuantKernel:
    """The kernel for `method` on device (cached per device, dtype and method, and logged
    once with the reasons the faster ones were passed over). Plugins are opt-in by name."""
    names = list(BUILTIN) if name == "auto" else [name]
    passed: dict[str, str] = {}
    for candidate in names:
        reason = why_not(candidate, device, dtype, method)
        if reason is None:
            log.info("quantized %s matmul on %s (%s): kernel %s%s", method, device, dtype,
                     candidate, "".join(f"; passed over {k}: {v}" for k, v in passed.items()))
            return load_kernel_class(candidate)()
        passed[candidate] = reason
    raise KernelUnavailableError(
        f"no quantized {method} kernel can run on {device} ({dtype}): "
        + "; ".join(f"{k}: {v}" for k, v in passed.items()))
