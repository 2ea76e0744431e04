"""GPT-OSS's mixture of experts, tensor-parallel as SparseMoE (layers/moe.py) is: every rank
holds every expert's slice of the intermediate size (gate and up by rows, down by columns),
and one all-reduce finishes the block. What GPT-OSS changes:

- the router is a linear layer with a bias, and the routing weights are a softmax over the
  top-k logits only (not the top-k of a softmax over all experts);
- every expert's projections have biases: gate_up's is split with its rows; down's is whole
  on every rank and added after the all-reduce, weighted by the token's routing weights, so
  it counts once at any tp;
- the activation is a clamped SwiGLU: gate clamped above at `limit`, up to +-limit, then
  gate * sigmoid(alpha * gate) * (up + 1).

The checkpoint stores the experts fused, gate and up interleaved in the last dimension:
gate_up_proj [experts, hidden, 2 * intermediate] (gate at even columns, up at odd ones),
gate_up_proj_bias [experts, 2 * intermediate], down_proj [experts, intermediate, hidden],
down_proj_bias [experts, hidden]; the released files hold the two weights as MXFP4
(layers/quant/mxfp4.py), read here through load_mxfp4. A rank's intermediate units [s, s + n) are
the contiguous columns [2 s, 2 (s + n)) of the interleaved layout, so each rank reads only its
slice and de-interleaves it into SparseMoE's [gate rows; up rows].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.distributed import all_reduce, get_tp
from tpserve.layers.moe import SparseMoE
from tpserve.layers.quant.mxfp4 import GROUP, dequantize
from tpserve.layers.sharding import copy_full, expect_shape, shard_size
from tpserve.weights import TensorSlice


class GptOssMoE(SparseMoE):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 prefix: str, alpha: float = 1.702, limit: float = 7.0) -> None:
        """prefix: the block's ("model.layers.{i}.mlp"); alpha, limit: the clamped SwiGLU's
        swiglu_alpha and swiglu_limit."""
        # Checked first, so the refusal names the tensor as GPT-OSS stores it.
        shard_size(intermediate, get_tp().size, tensor=f"{prefix}.experts.gate_up_proj",
                   what="expert intermediate size", shape=(num_experts, hidden, 2 * intermediate))
        super().__init__(hidden, intermediate, num_experts, top_k, "silu", prefix,
                         renormalize=False, names=("gate_up_proj", "gate_up_proj", "down_proj"),
                         fused_names=("experts.gate_up_proj", "experts.down_proj"))
        self.alpha, self.limit = float(alpha), float(limit)
        del self.gate  # GPT-OSS's router has a bias and a name of its own
        self.router = nn.Linear(hidden, num_experts, bias=True)
        self.b13 = nn.Parameter(torch.empty(num_experts, 2 * self.part), requires_grad=False)
        self.b2 = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        for p in (self.router.weight, self.router.bias):
            p.requires_grad_(False)
            p.weight_loader = copy_full
        self.w13.weight_loader = self._load_gate_up
        self.b13.weight_loader = self._load_gate_up_bias
        self.w2.weight_loader = self._load_down
        self.b2.weight_loader = copy_full
        # w13 and w2 load by name through load_into (the family's rename) or as MXFP4
        # (load_mxfp4); either way `loaded` records them for the family's check.
        self.loaded: set[str] = set()

    # --- loading --------------------------------------------------------------------------
    def _rows(self) -> tuple[int, int]:
        """This rank's columns of the interleaved [gate, up] dimension: (start, length)."""
        return 2 * get_tp().rank * self.part, 2 * self.part

    def _deinterleave_into(self, out: torch.Tensor, pairs: torch.Tensor, dim: int) -> None:
        """pairs: this rank's interleaved (gate, up) entries along dim; out: [gate; up]."""
        n = self.part
        pairs = pairs.unflatten(dim, (n, 2))
        out.narrow(dim, 0, n).copy_(pairs.select(dim + 1, 0))
        out.narrow(dim, n, n).copy_(pairs.select(dim + 1, 1))

    def _load_gate_up(self, param: torch.Tensor, w: TensorSlice) -> None:
        expect_shape(w, (self.num_experts, self.hidden, 2 * self.intermediate))
        start, length = self._rows()
        for e in range(self.num_experts):  # an expert at a time bounds the host copy
            cols = w[e, :, start:start + length]  # [hidden, 2 n]
            self._deinterleave_into(param.data[e], cols.t(), 0)
        self.loaded.add("gate_up_proj")

    def _load_gate_up_bias(self, param: torch.Tensor, w: TensorSlice) -> None:
        expect_shape(w, (self.num_experts, 2 * self.intermediate))
        start, length = self._rows()
        self._deinterleave_into(param.data, w[:, start:start + length], 1)

    def _load_down(self, param: torch.Tensor, w: TensorSlice) -> None:
        expect_shape(w, (self.num_experts, self.intermediate, self.hidden))
        start = get_tp().rank * self.part
        for e in range(self.num_experts):
            param.data[e].copy_(w[e, start:start + self.part, :].t())
        self.loaded.add("down_proj")

    def load_mxfp4(self, which: str, blocks: TensorSlice, scales: TensorSlice) -> None:
        """which: "gate_up_proj" or "down_proj", stored as MXFP4 rows of output features:
        blocks [experts, rows, in / 32, 16] and scales [experts, rows, in / 32]. Each expert's
        slice of this rank is dequantized into the model dtype on the way in."""
        e, h, i = self.num_experts, self.hidden, self.intermediate
        gate_up = which == "gate_up_proj"
        rows, cols = (2 * i, h) if gate_up else (h, i)
        if cols % GROUP:
            raise ValueError(f"checkpoint tensor {blocks.name!r}: MXFP4 groups of {GROUP} "
                             f"need input features divisible by {GROUP}, not {cols}")
        expect_shape(blocks, (e, rows, cols // GROUP, GROUP // 2))
        expect_shape(scales, (e, rows, cols // GROUP))
        if gate_up:
            start, length = self._rows()
            for x in range(e):
                dense = dequantize(blocks[x, start:start + length], scales[x, start:start + length],
                                   self.w13.dtype)  # [2 n interleaved rows, hidden]
                self._deinterleave_into(self.w13.data[x], dense, 0)
        else:
            # The rank's input columns [s, s + n) may start or end inside a group of 32: it
            # reads the groups that cover them (at most one more group per row at each end).
            s, n = get_tp().rank * self.part, self.part
            g0, g1 = s // GROUP, -(-(s + n) // GROUP)
            for x in range(e):
                dense = dequantize(blocks[x, :, g0:g1], scales[x, :, g0:g1], self.w2.dtype)
                self.w2.data[x].copy_(dense[:, s - g0 * GROUP:s - g0 * GROUP + n])
        self.loaded.add(which)

    # --- running --------------------------------------------------------------------------
    def route(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] weights: a softmax over the top-k router logits (float32), zero
        for the experts a token is not routed to."""
        logits = self.router(x)
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top.float(), dim=-1)
        return torch.zeros(logits.shape, dtype=torch.float32, device=x.device).scatter(
            1, idx, weights)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.w13[e], self.b13[e])
        gate = h[:, : self.part].clamp(max=self.limit)
        up = h[:, self.part:].clamp(-self.limit, self.limit)
        return F.linear(gate * torch.sigmoid(gate * self.alpha) * (up + 1), self.w2[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.route(x)
        out = all_reduce(self.combine(x, weights))
        return out + (weights @ self.b2.float()).to(x.dtype)
