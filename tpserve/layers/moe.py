"""A mixture-of-experts MLP (Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse block),
tensor-parallel: every rank holds every expert's slice, its gate and up projections by output
rows and its down projection by input columns (as GatedMLP), so one all-reduce after the
experts finishes the block, whatever the routing. The router is replicated.

Routing follows transformers' sparse blocks: softmax over the router's logits in float32, the
top num_experts_per_tok, those weights renormalised to sum to one where the family does
(Mixtral always, Qwen's by `norm_topk_prob`); each chosen expert's output, scaled by its
weight, is added in expert order.

Two ways to run the experts, same sums: eagerly (prefill, or devices without graphs) each
expert runs on the tokens routed to it; inside a CUDA graph capture, where shapes must not
depend on the routing, each expert runs on every token and a weight of zero drops the
tokens not routed to it (more arithmetic, but a decode step reads every expert's weights
anyway once the batch has a few tokens).

Two ways to hold the experts, chosen when the block is built: float experts are stacked
([expert, ...] tensors, one F.linear per expert); the experts of a quantized checkpoint
(GPTQ, AWQ, fp8, compressed-tensors) are one QuantizedExpert each, a gated MLP of the
shared linear layers, so each expert's gate/up and down hold and multiply their weights as
the dense layers' methods do (layers/quant/methods.py) and load from the checkpoint's
per-expert tensors by name (models/experts.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.distributed import all_reduce, get_tp
from tpserve.kernels.capabilities import stream_capturing
from tpserve.layers.activation import GatedActivation
from tpserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tpserve.layers.quant.config import QuantizationError, current_quant
from tpserve.layers.quant.methods import UnquantizedMethod, linear_method
from tpserve.layers.sharding import copy_full, copy_narrow, expect_shape, shard_size
from tpserve.weights import TensorSlice

_ACTS = {"silu": F.silu, "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

PARTS = ("gate", "up", "down")


def quantized_experts() -> bool:
    """Whether the block being built holds a quantized checkpoint's experts (one
    QuantizedExpert each). --quantize fp8 on a float checkpoint (a cast at load) keeps the
    stacked float experts, as before quantized experts were read."""
    q = current_quant()
    return q is not None and not q.cast_at_load


def refuse_quantized_router(module: str) -> None:
    """A router (or Qwen2-MoE's shared_expert_gate) is float in the released checkpoints.
    compressed-tensors names every float Linear in its ignore list, so one it does not name
    is quantized: refused at start (a router's quantized tensors are refused at load,
    models/experts.py)."""
    q = current_quant()
    if q is not None and q.explicit_float and \
            not isinstance(linear_method(module), UnquantizedMethod):
        raise QuantizationError(
            f"this checkpoint quantizes the router {module!r} (its compressed-tensors ignore "
            f"list does not name it); tpserve keeps routers float, as the released quantized "
            f"mixture-of-experts checkpoints store them: use a checkpoint whose ignore list "
            f"names it (e.g. 're:.*mlp.gate$')")


class QuantizedExpert(nn.Module):
    """One expert of a quantized checkpoint: [gate; up] column-parallel (fused as GatedMLP
    fuses them) and down row-parallel, each with its layer's quantization method. forward
    returns the rank's partial sums: the block all-reduces once for every expert."""

    def __init__(self, hidden: int, intermediate: int, act: str, prefix: str,
                 names: tuple[str, str, str]) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden, [intermediate, intermediate], prefix=prefix, part_names=list(names[:2]),
            what="expert intermediate size")
        self.act = GatedActivation(act)
        self.down_proj = RowParallelLinear(intermediate, hidden, prefix=f"{prefix}.{names[2]}")
        self.act.fuse_with(self.gate_up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.partial(self.act.project(self.gate_up_proj, x))


class SparseMoE(nn.Module):
    """names: the checkpoint's names of each expert's gate, up and down projections
    (experts.{e}.{name}.weight under prefix), for loading and for the errors that name them.
    renormalize: the top-k weights rescaled to sum to one (Qwen's norm_topk_prob)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 act: str, prefix: str, renormalize: bool = True,
                 names: tuple[str, str, str] = ("w1", "w3", "w2"),
                 fused_names: tuple[str, str] | None = None, router: str = "gate") -> None:
        """fused_names: where the checkpoint holds the experts only fused, the names of the
        [experts, (gate; up), hidden] and [experts, hidden, intermediate] tensors under
        prefix (GraniteMoE's input_linear.weight, output_linear.weight), which errors name.
        router: the router's checkpoint module under prefix (Llama 4's "router")."""
        super().__init__()
        tp = get_tp()
        if act not in _ACTS:
            raise ValueError(f"expert activation {act!r} is not supported (supported: "
                             f"{', '.join(_ACTS)})")
        self.hidden, self.intermediate = hidden, intermediate
        self.num_experts, self.top_k, self.act = num_experts, top_k, _ACTS[act]
        self.renormalize, self.prefix = renormalize, prefix
        self.names = dict(zip(PARTS, names, strict=True))
        self.fused_names = fused_names
        shape = (intermediate, hidden) if fused_names is None \
            else (num_experts, 2 * intermediate, hidden)
        self.part = shard_size(intermediate, tp.size, tensor=self.tensor_name(0, "gate"),
                               what="expert intermediate size", shape=shape)
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.gate.weight.weight_loader = copy_full
        self.experts: nn.ModuleList | None = None
        if quantized_experts() and fused_names is None:
            refuse_quantized_router(f"{prefix}.{router}")
            self.experts = nn.ModuleList(
                QuantizedExpert(hidden, intermediate, act, f"{prefix}.experts.{e}", names)
                for e in range(num_experts))
            self.w13 = self.w2 = None
            return
        # [expert, (gate rows; up rows) of this rank, hidden] and [expert, hidden, down columns].
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.part, hidden),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.part), requires_grad=False)
        # Loaded through load_expert / load_fused, not load_into (models/experts.py checks).
        self.w13.optional = self.w2.optional = True

    def tensor_name(self, expert: int, part: str) -> str:
        if self.fused_names is not None:
            return f"{self.prefix}.{self.fused_names[part == 'down']}"
        return f"{self.prefix}.experts.{expert}.{self.names[part]}.weight"

    def check_expert(self, expert: int, w: TensorSlice) -> None:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint tensor {w.name!r} names expert {expert}, but the "
                             f"config has {self.num_experts}")

    def load_expert(self, expert: int, part: str, w: TensorSlice) -> None:
        """One expert's gate, up or down projection as stored per expert: this rank's rows
        (gate, up) or columns (down)."""
        self.check_expert(expert, w)
        start = get_tp().rank * self.part
        if part == "down":
            expect_shape(w, (self.hidden, self.intermediate))
            copy_narrow(self.w2[expert], w, 1, start, self.part)
            return
        expect_shape(w, (self.intermediate, self.hidden))
        copy_narrow(self.w13[expert], w, 0, start, self.part,
                    out_offset=0 if part == "gate" else self.part)

    def load_fused(self, which: str, w: TensorSlice) -> None:
        """Every expert at once, as transformers 5 holds them (and saves them with
        save_original_format=False): gate_up_proj [expert, (gate; up), hidden] and
        down_proj [expert, hidden, intermediate]."""
        start = get_tp().rank * self.part
        if which == "down_proj":
            expect_shape(w, (self.num_experts, self.hidden, self.intermediate))
            copy_narrow(self.w2, w, 2, start, self.part)
            return
        expect_shape(w, (self.num_experts, 2 * self.intermediate, self.hidden))
        copy_narrow(self.w13, w, 1, start, self.part)
        copy_narrow(self.w13, w, 1, self.intermediate + start, self.part, out_offset=self.part)

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] weights: the top-k of the router's softmax (renormalised where
        the family does), zero for the experts a token is not routed to."""
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        top, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter(1, idx, top)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.experts is not None:
            return self.experts[e](x)
        h = F.linear(x, self.w13[e])
        return F.linear(self.act(h[:, : self.part]) * h[:, self.part:], self.w2[e])

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the block's output, before the all-reduce."""
        return self.combine(x, self.route(x))

    def combine(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The sum of each expert's output on this rank scaled by its [tokens, experts]
        routing weight."""
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
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x))
