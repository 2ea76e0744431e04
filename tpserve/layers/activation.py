"""Activations by their transformers names, and gated ones over a fused [gate; up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.kernels import gemv
from tpserve.kernels.fused_ops import GATED_ACTS, gated_act, plan_act
from tpserve.layers import lora


def bloom_gelu(x: torch.Tensor) -> torch.Tensor:
    """Bloom's tanh GELU, with its rounded constant, as transformers computes it."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


_ACTS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    # Squared ReLU (Nemotron's hidden_act), as transformers' ReLUSquaredActivation.
    "relu2": lambda x: torch.square(F.relu(x)),
    "bloom_gelu": bloom_gelu,
}


def get_activation(name: str):
    if name not in _ACTS:
        raise ValueError(f"activation {name!r} is not supported; supported: {', '.join(_ACTS)}")
    return _ACTS[name]


class GatedActivation(nn.Module):
    """act(gate) * up, where x = [gate; up] along the last dimension."""

    def __init__(self, act: str) -> None:
        super().__init__()
        self.name, self.act = act, get_activation(act)
        plan_act(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One kernel for silu and the tanh GELU where the device has it, else torch.
        return gated_act(x, self.name, self.act)

    def fuse_with(self, proj: nn.Module) -> None:
        """Let `proj` (the [gate; up] projection feeding this activation) run one-row steps
        with the activation in its GEMV (kernels/gemv.py `gated`): for a float weight with no
        bias. Warmup times it against the two launches and sets proj.gemv_gated_tile where
        it is faster (gemv.assign)."""
        if (self.name in GATED_ACTS and hasattr(proj, "gemv_tile")
                and getattr(proj, "bias", None) is None):
            proj.gemv_gated = GATED_ACTS[self.name]
            proj.gemv_gated_tile = None

    def project(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """self(proj(x)), in one launch for one row where warmup chose the fused GEMV for
        proj, or where proj's quantized weights have such a launch (LinearMethod.apply_gated);
        two launches otherwise."""
        if x.numel() == x.shape[-1] and not lora.active(proj):
            tile = getattr(proj, "gemv_gated_tile", None)
            if tile is not None:
                y = gemv.gated(x, proj.weight, tile, proj.gemv_gated)
                return y.view(*x.shape[:-1], y.shape[-1])
            method = getattr(proj, "method", None)
            if (method is not None and self.name in GATED_ACTS
                    and getattr(proj, "bias", None) is None):
                y = method.apply_gated(proj, x, GATED_ACTS[self.name])
                if y is not None:
                    return y
        return self(proj(x))
