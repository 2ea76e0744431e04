"""A CUDA graph's stand-in on the CPU: between capture_begin() and capture_end() it records
every aten op with the very tensors it read and wrote (a TorchDispatchMode), and replay()
runs the ops again on those tensors, copying each fresh result into the tensor the capture
produced. Like a real graph, a replay reads whatever its input tensors hold now and writes
the same output tensors; unlike one it also runs the ops during capture (harmless: the
captured values are recomputed by every replay)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _Record(TorchDispatchMode):
    def __init__(self, ops: list) -> None:
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _aliases(func) -> bool:
    """Views and in-place ops: their captured outputs share memory with inputs that the
    replay has already refreshed (a view) or refreshes itself (an in-place op)."""
    return any(r.alias_info is not None for r in func._schema.returns)


class OpGraph:
    def __init__(self) -> None:
        self.ops: list = []
        self.replays = 0
        self._mode: _Record | None = None

    def capture_begin(self, pool=None) -> None:
        self._mode = _Record(self.ops)
        self._mode.__enter__()

    def capture_end(self) -> None:
        self._mode.__exit__(None, None, None)

    def pool(self):
        return None

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            res = func(*args, **kwargs)
            if _aliases(func):
                continue
            if isinstance(out, torch.Tensor):
                out.copy_(res)
            elif isinstance(out, (tuple, list)):
                for o, r in zip(out, res, strict=True):
                    if isinstance(o, torch.Tensor):
                        o.copy_(r)


class _NoStream:
    def __init__(self, device) -> None:
        pass


class _UseStream:
    def __init__(self, stream) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def cpu_piece_capture_api(dev):
    """piece_capture_api's shape (cluster/device.py) for the CPU."""
    return OpGraph, _NoStream, _UseStream
