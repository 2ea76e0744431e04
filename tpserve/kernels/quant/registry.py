"""Lazy registry of quantized-matmul kernels, mirroring the attention registry: built-ins by
module path, plugins (an IPEX or SYCL int4 GEMM) by entry point in group
`tpserve.quant_kernels`. Nothing is imported until asked for, so a missing Triton never breaks
`import tpserve`."""

from __future__ import annotations

import functools
import logging

import torch

from tpserve.errors import KernelUnavailableError
from tpserve.kernels.lazy_classes import LazyClasses
from tpserve.kernels.quant.base import QuantKernel

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "tpserve.quant_kernels"

# Preference order for auto: the fastest that supports the device comes first.
BUILTIN: dict[str, str] = {
    "triton": "tpserve.kernels.quant.triton_kernel:TritonQuantKernel",
    "torch": "tpserve.kernels.quant.torch_ref:TorchQuantKernel",
}


_CLASSES = LazyClasses("quantized-matmul kernel", ENTRY_POINT_GROUP, BUILTIN, QuantKernel)


def available_names() -> list[str]:
    return _CLASSES.names()


def load_kernel_class(name: str) -> type[QuantKernel]:
    """Import one kernel class; raises KernelUnavailableError naming what failed."""
    return _CLASSES.load(name)


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
