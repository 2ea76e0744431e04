"""A mixture-of-experts MLP (Mixtral's sparse block), tensor-parallel: every rank holds every
expert's slice, its gate and up projections by output rows and its down projection by input
columns (as GatedMLP), so one all-reduce after the experts finishes the block, whatever the
routing. The router is replicated.

Routing follows transformers' MixtralSparseMoeBlock: softmax over the router's logits in
float32, the top num_experts_per_tok, those weights renormalised to sum to one; each chosen
expert's output, scaled by its weight, is added in expert order.

Two ways to run the experts, same sums: eagerly (prefill, or devices without graphs) each
expert runs on the tokens routed to it; inside a CUDA graph capture, where shapes must not
depend on the routing, each expert runs on every token and a weight of zero drops the
tokens not routed to it (more arithmetic, but a decode step reads every expert's weights
anyway once the batch has a few tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.distributed import all_reduce, get_tp
from tpserve.kernels.capabilities import stream_capturing
from tpserve.layers.sharding import copy_full, copy_narrow, expect_shape, shard_size
from tpserve.weights import TensorSlice

_ACTS = {"silu": F.silu, "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class SparseMoE(nn.Module):
    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 act: str, prefix: str) -> None:
        super().__init__()
        tp = get_tp()
        if act not in _ACTS:
            raise ValueError(f"expert activation {act!r} is not supported (supported: "
                             f"{', '.join(_ACTS)})")
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k, self.act = num_experts, top_k, _ACTS[act]
        self.part = shard_size(intermediate, tp.size, tensor=f"{prefix}.experts.0.w1.weight",
                               what="intermediate size", shape=(intermediate, hidden))
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.gate.weight.weight_loader = copy_full
        # [expert, (w1 rows; w3 rows) of this rank, hidden] and [expert, hidden, w2 columns].
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.part, hidden),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.part), requires_grad=False)

    def load_expert(self, expert: int, which: str, w: TensorSlice) -> None:
        """Checkpoint tensor experts.{expert}.{w1|w2|w3}.weight: this rank's rows (w1, w3)
        or columns (w2)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {w.name!r} names expert {expert}, but the "
                             f"config has {self.num_experts} (num_local_experts)")
        start = get_tp().rank * self.part
        if which == "w2":
            expect_shape(w, (self.hidden, self.intermediate))
            copy_narrow(self.w2[expert], w, 1, start, self.part)
            return
        expect_shape(w, (self.intermediate, self.hidden))
        copy_narrow(self.w13[expert], w, 0, start, self.part,
                    out_offset=0 if which == "w1" else self.part)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] weights: the renormalised top-k of the router's softmax, zero
        for the experts a token is not routed to."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, idx, top)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = F.linear(x, self.w13[e])
        return F.linear(self.act(h[:, : self.part]) * h[:, self.part:], self.w2[e])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.route(x)
        out = torch.zeros_like(x)
        if stream_capturing(x.device):
            for e in range(self.num_experts):
                out += (self.expert(e, x) * weights[:, e:e + 1]).to(x.dtype)
        else:
            # Each expert's tokens, expert by expert, with two host syncs for the whole
            # block (not one per expert).
            routed = weights > 0
            tokens = routed.t().nonzero()[:, 1].split(routed.sum(0).tolist())
            for e, rows in enumerate(tokens):
                if rows.numel():
                    y = self.expert(e, x[rows]) * weights[rows, e:e + 1]
                    out.index_add_(0, rows, y.to(x.dtype))
        return all_reduce(out)
