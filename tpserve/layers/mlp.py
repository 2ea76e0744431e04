"""The plain (not gated) feed-forward block: up -> activation -> down, the up projection
split by rows and the down one by columns (its bias added once, after the all-reduce).
Bloom, StarCoder2, GPT-NeoX and Phi name the two projections each their own way."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.activation import get_activation
from tpserve.layers.linear import ColumnParallelLinear, RowParallelLinear


class PlainMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, prefix: str,
                 names: tuple[str, str], bias: bool = True) -> None:
        """names: the checkpoint's names of the up and down projections (the parameters
        carry them, so the file's tensors load by name)."""
        super().__init__()
        self.up_name, self.down_name = names
        self.add_module(self.up_name, ColumnParallelLinear(
            hidden, intermediate, bias=bias, prefix=f"{prefix}.{self.up_name}"))
        self.act = get_activation(act)
        self.add_module(self.down_name, RowParallelLinear(
            intermediate, hidden, bias=bias, prefix=f"{prefix}.{self.down_name}"))

    @property
    def up(self) -> ColumnParallelLinear:
        return getattr(self, self.up_name)

    @property
    def down(self) -> RowParallelLinear:
        return getattr(self, self.down_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.hidden(x))

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """The activation between the projections (this rank's columns): down's input."""
        return self.act(self.up(x))
