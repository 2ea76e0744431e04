"""Gated activations over a fused [gate; up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def get_activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_ACTS)}")
    return _ACTS[name]


class GatedActivation(nn.Module):
    """act(gate) * up, where x = [gate; up] along the last dimension."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
