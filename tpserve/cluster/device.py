"""Device detection and the torch.distributed backend per device.

Every vendor-specific call of the engine lives here (and in the kernel backends), so the
rest of the code only sees a torch.device.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

log = logging.getLogger(__name__)

DEVICES = ("cpu", "cuda", "xpu")


def xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def detect_device() -> tuple[str, str]:
    """(device type, why) for --device auto on this machine."""
    if torch.cuda.is_available():
        return "cuda", f"{torch.cuda.device_count()} CUDA device(s) visible"
    if xpu_available():
        return "xpu", f"{torch.xpu.device_count()} XPU device(s) visible (upstream PyTorch XPU)"
    return "cpu", "no CUDA or XPU device visible to PyTorch"


def resolve_device(requested: str) -> tuple[str, str]:
    if requested == "auto":
        return detect_device()
    if requested not in DEVICES:
        raise ValueError(f"--device must be one of auto, {', '.join(DEVICES)}; got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda asked for, but PyTorch sees no CUDA device "
                           f"(torch {torch.__version__}, built for CUDA: {torch.version.cuda})")
    if requested == "xpu" and not xpu_available():
        raise RuntimeError("--device xpu asked for, but PyTorch sees no XPU: install a PyTorch "
                           "build with XPU support (torch>=2.8 from the XPU wheel index) and "
                           "Intel's GPU driver")
    return requested, "asked for with --device"


def dist_backend(device: str) -> str:
    """The torch.distributed backend for all-reduce between shards on `device`."""
    if device == "cuda":
        return "nccl"
    if device == "xpu":
        # oneCCL bindings register "ccl" when imported; upstream PyTorch >= 2.8 has "xccl".
        if importlib.util.find_spec("oneccl_bindings_for_pytorch") is not None:
            import oneccl_bindings_for_pytorch  # noqa: F401

            return "ccl"
        return "xccl"
    return "gloo"


def local_device(device: str) -> torch.device:
    """This process's device. Ray narrows the visible accelerators of each shard actor
    (CUDA_VISIBLE_DEVICES / ONEAPI_DEVICE_SELECTOR) to its own, so that is index 0."""
    if device == "cpu":
        return torch.device("cpu")
    dev = torch.device(device, 0)
    if hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(0)
    else:
        getattr(torch, device).set_device(0)
    return dev


def memory_info(dev: torch.device) -> tuple[int, int]:
    """(free, total) bytes on an accelerator."""
    return getattr(torch, dev.type).mem_get_info(dev)


def synchronize(dev: torch.device) -> None:
    if dev.type != "cpu":
        getattr(torch, dev.type).synchronize(dev)


def graph_api(dev: torch.device):
    """(graph class, capture context manager) where whole-step graphs can be captured on
    this device, else None. Only CUDA graphs are used (and were run); XPU graphs exist in
    recent PyTorch but have not been tried."""
    if dev.type == "cuda":
        return torch.cuda.CUDAGraph, torch.cuda.graph
    return None


def resolve_dtype(requested: str, device: str, checkpoint_dtype) -> tuple[str, str]:
    """(dtype name, why). auto: the checkpoint's dtype on accelerators; float32 on the CPU,
    where half precision matmuls are slow and the reference is float32."""
    if requested != "auto":
        return requested, "asked for with --dtype"
    if device == "cpu":
        return "float32", "CPU: float32 is the fast and exact path there"
    name = str(checkpoint_dtype or "bfloat16").replace("torch.", "")
    if name == "float32":
        return "bfloat16", "checkpoint is float32; serving accelerators in bfloat16"
    return name, f"the checkpoint's dtype ({name})"


def ray_bundle(device: str, cpus_per_shard: int) -> dict[str, float]:
    if device == "cpu":
        return {"CPU": float(cpus_per_shard)}
    # Ray reports Intel GPUs as GPU resources as well and sets ONEAPI_DEVICE_SELECTOR.
    return {"GPU": 1.0, "CPU": 1.0}
