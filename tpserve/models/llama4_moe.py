"""Llama 4's mixture of experts, tensor-parallel as SparseMoE (layers/moe.py) is: every rank
holds every expert's slice of the intermediate size (gate and up by rows, down by columns)
and its slice of the shared expert, and one all-reduce finishes the block. What Llama 4
changes:

- routing: the top num_experts_per_tok router logits, each through a sigmoid (no softmax,
  no renormalisation), and that weight scales the expert's INPUT, not its output
  (expert(w * x); the SwiGLU is not linear, so the two differ);
- a shared expert (a gated MLP of intermediate_size, ungated) every token goes through,
  its output added to the experts';
- the checkpoint stores the experts fused and transposed against SparseMoE's layout:
  experts.gate_up_proj [experts, hidden, 2 * intermediate] (gate columns first, then up,
  as transformers' chunk(2) reads them) and experts.down_proj [experts, intermediate,
  hidden]; the router is router.weight [experts, hidden].

A quantized checkpoint (fp8: Meta's Maverick FP8, llm-compressor's releases; int4: GPTQ,
AWQ, compressed-tensors) stores the experts one by one instead, experts.{e}.gate_proj / up_proj / down_proj with the tensors a
dense linear has in that format: those become one QuantizedExpert each (layers/moe.py), as
the other mixture-of-experts families' quantized experts; the router stays float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpserve.distributed import get_tp
from tpserve.kernels.capabilities import stream_capturing
from tpserve.layers.moe import SparseMoE, quantized_experts
from tpserve.layers.sharding import expect_shape, shard_size
from tpserve.models.llama import GatedMLP
from tpserve.weights import TensorSlice


class Llama4MoE(SparseMoE):
    def __init__(self, config, prefix: str) -> None:
        """prefix: the block's checkpoint name ("model.layers.{i}.feed_forward"), for errors."""
        h, i, e = config.hidden_size, config.intermediate_size, config.num_local_experts
        quantized = quantized_experts()
        # Checked first, so the refusal names the tensor as Llama 4 stores it.
        shard_size(i, get_tp().size, tensor=f"{prefix}.experts.0.gate_proj.weight" if quantized
                   else f"{prefix}.experts.gate_up_proj", what="expert intermediate size",
                   shape=(i, h) if quantized else (e, h, 2 * i))
        names = ("gate_proj", "up_proj", "down_proj") if quantized else \
            ("gate_up_proj", "gate_up_proj", "down_proj")
        fused = None if quantized else ("experts.gate_up_proj", "experts.down_proj")
        super().__init__(h, i, e, config.num_experts_per_tok, config.hidden_act, prefix,
                         renormalize=False, names=names, fused_names=fused, router="router")
        self.shared_expert = GatedMLP(h, i, config.hidden_act, f"{prefix}.shared_expert")
        if self.experts is None:
            # Loaded by name through load_into (the family's rename), required like any weight.
            self.w13.weight_loader, self.w2.weight_loader = self._load_gate_up, self._load_down
            self.w13.optional = self.w2.optional = False

    def _load_gate_up(self, param: torch.Tensor, w: TensorSlice) -> None:
        expect_shape(w, (self.num_experts, self.hidden, 2 * self.intermediate))
        s, n = get_tp().rank * self.part, self.part
        for e in range(self.num_experts):  # an expert at a time bounds the host copy
            param.data[e, :n].copy_(w[e, :, s:s + n].t())
            up = self.intermediate + s
            param.data[e, n:].copy_(w[e, :, up:up + n].t())

    def _load_down(self, param: torch.Tensor, w: TensorSlice) -> None:
        expect_shape(w, (self.num_experts, self.intermediate, self.hidden))
        s, n = get_tp().rank * self.part, self.part
        for e in range(self.num_experts):
            param.data[e].copy_(w[e, s:s + n, :].t())

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, experts] input scales in x's dtype: sigmoid of each top-k logit (in
        float32, as transformers), zero for the experts a token is not routed to."""
        logits = F.linear(x, self.gate.weight)
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(top.float()).to(x.dtype)
        return torch.zeros_like(logits).scatter(1, idx, scores)

    def combine(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The sum of each expert's output on this rank for its input scaled by the token's
        weight (an expert a token is not routed to gets a zero input, and without biases
        gives zero: the capture path runs every expert on every token)."""
        out = torch.zeros_like(x)
        if stream_capturing(x.device):
            for e in range(self.num_experts):
                out += self.expert(e, x * weights[:, e:e + 1])
            return out
        routed = weights > 0
        tokens = routed.t().nonzero()[:, 1].split(routed.sum(0).tolist())
        for e, rows in enumerate(tokens):
            if rows.numel():
                out.index_add_(0, rows, self.expert(e, x[rows] * weights[rows, e:e + 1]))
        return out

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        mlp = self.shared_expert
        shared = mlp.down_proj.partial(mlp.act.project(mlp.gate_up_proj, x))
        return self.combine(x, self.route(x)) + shared
