"""Device detection and the torch.distributed backend per device.

Every vendor-specific call of the engine lives here (and in the kernel backends), so the
rest of the code only sees a torch.device.
"""

from __future__ import annotations

import importlib
import logging
import os

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


class Platform:
    """What device selection asks of the machine, in one place so tests can fake it: the
    environment, Ray's GPU assignment, device counts, optional imports."""

    def __init__(self) -> None:
        self.env = os.environ

    def ray_gpu_ids(self) -> list[str]:
        try:
            import ray

            return [str(i) for i in ray.get_gpu_ids()] if ray.is_initialized() else []
        except Exception:  # noqa: BLE001 - outside a Ray worker there is no assignment
            return []

    def device_count(self, device: str) -> int:
        return getattr(torch, device).device_count()

    def import_module(self, name: str):
        return importlib.import_module(name)

    def xccl_available(self) -> bool:
        check = getattr(torch.distributed, "is_xccl_available", None)
        return bool(check and check())


def dist_backend(device: str, platform: Platform | None = None) -> str:
    """The torch.distributed backend for all-reduce between shards on `device`."""
    if device == "cuda":
        return "nccl"
    if device != "xpu":
        return "gloo"
    platform = platform or Platform()
    # Intel's oneCCL bindings register "ccl" when imported; upstream PyTorch >= 2.8 has
    # "xccl" built in. The bindings win when they import: a user installed them on purpose.
    try:
        platform.import_module("oneccl_bindings_for_pytorch")
    except ImportError as exc:
        why = ("oneccl_bindings_for_pytorch is not installed" if exc.name ==
               "oneccl_bindings_for_pytorch" else f"oneccl_bindings_for_pytorch does not import: "
               f"{exc}")
    else:
        log.info("xpu collectives: ccl (oneccl_bindings_for_pytorch imported)")
        return "ccl"
    if not platform.xccl_available():
        raise RuntimeError(
            f"no collective backend for XPU: {why}, and this PyTorch has no xccl "
            f"(torch {torch.__version__}). Install PyTorch >= 2.8 from the XPU wheel index, or "
            "oneccl_bindings_for_pytorch matching your PyTorch.")
    log.info("xpu collectives: xccl (built into PyTorch; %s)", why)
    return "xccl"


def accelerator_index(device: str, platform: Platform | None = None) -> tuple[int, str]:
    """(index of this shard's device among those the process sees, why).

    Each shard actor asks Ray for one GPU. With NVIDIA GPUs Ray sets CUDA_VISIBLE_DEVICES, and
    with Intel GPUs (detected through dpctl) ZE_AFFINITY_MASK, so the process sees exactly
    its device at index 0. When Ray counts Intel GPUs without its Intel support (no dpctl on
    the node; the GPU resource was given with `ray start --num-gpus` or by tpserve), nothing
    masks the tiles: the shard then takes the tile of the GPU id Ray assigned it.
    """
    platform = platform or Platform()
    env = platform.env
    if device == "cuda":
        return 0, f"CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '(unset)')}"
    mask = env.get("ZE_AFFINITY_MASK")
    selector = env.get("ONEAPI_DEVICE_SELECTOR")
    if mask or selector:
        seen = platform.device_count(device)
        why = f"ZE_AFFINITY_MASK={mask}" if mask else f"ONEAPI_DEVICE_SELECTOR={selector}"
        if seen != 1:
            log.warning("%s leaves %d XPU devices visible to this shard; using the first. With "
                        "tiles as devices (ZE_FLAT_DEVICE_HIERARCHY=FLAT, the default) each "
                        "Ray GPU is one tile.", why, seen)
        return 0, why
    ids = platform.ray_gpu_ids()
    if ids:
        index = int(ids[0])
        seen = platform.device_count(device)
        if index >= seen:
            raise RuntimeError(
                f"Ray assigned GPU {index} to this shard but only {seen} XPU device(s) are "
                "visible: give Ray as many GPUs as there are tiles (`ray start --num-gpus N`)")
        return index, f"Ray GPU id {index}; no ZE_AFFINITY_MASK set (Ray without dpctl)"
    return 0, "no Ray GPU assignment and no device mask: the first device"


def local_device(device: str, platform: Platform | None = None) -> torch.device:
    """This process's device: the one Ray assigned to this shard (accelerator_index)."""
    if device == "cpu":
        return torch.device("cpu")
    index, why = accelerator_index(device, platform)
    log.info("%s device index %d (%s)", device, index, why)
    dev = torch.device(device, index)
    if hasattr(torch, "accelerator"):
        torch.accelerator.set_device_index(index)
    else:
        getattr(torch, device).set_device(index)
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


def piece_capture_api(dev: torch.device):
    """(graph class, stream class, stream context) for graphs captured in pieces
    (worker/piecewise.py): capture_begin / capture_end by hand, on a side stream, as
    torch.cuda.graph does for a whole graph. CUDA only, like graph_api."""
    if dev.type != "cuda":
        raise RuntimeError(f"graphs are captured on CUDA only (device is {dev.type})")
    return torch.cuda.CUDAGraph, torch.cuda.Stream, torch.cuda.stream


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


def local_cluster_gpus(device: str) -> int | None:
    """GPUs to declare when tpserve starts a local Ray cluster: Ray finds Intel GPUs only
    through dpctl, so XPU tiles are counted with torch instead; None: Ray's own count."""
    if device == "xpu":
        return torch.xpu.device_count()
    return None


def collective_failed(exc: BaseException) -> bool:
    """torch.distributed's own errors (NCCL and the c10d store), and gloo's, which arrive as
    plain RuntimeErrors naming gloo (a reset connection, a timed-out receive)."""
    from torch.distributed import DistError

    text = str(exc).lower()
    return isinstance(exc, DistError) or "gloo" in text or "nccl" in text
