"""DeepSeek-V2 / V3's sparse block: routed experts split across the ranks as every SparseMoE
is (layers/moe.py), shared experts as one gated MLP of moe_intermediate_size *
n_shared_experts added unscaled, and the two routers as transformers computes them, in
float32 on a float32, replicated router weight:

- V2: softmax scores; the top num_experts_per_tok of all experts (topk_method "greedy") or
  of the topk_group groups of experts with the highest best score ("group_limited_greedy");
  weights are the chosen scores times routed_scaling_factor.
- V3: sigmoid scores; experts are chosen by score + e_score_correction_bias among the
  topk_group groups whose two best biased scores sum highest ("noaux_tc"), weighted by
  their unbiased scores, renormalised (norm_topk_prob) and times routed_scaling_factor.

The shared experts' partial sums join the routed experts' before the block's one
all-reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.layers.moe import SparseMoE
from tpserve.layers.sharding import copy_full
from tpserve.models.llama import GatedMLP

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _group_mask(choice: torch.Tensor, groups: int, keep: int, per_group_score) -> torch.Tensor:
    """[T, E] True for the experts of each token's `keep` best groups by per_group_score."""
    t, e = choice.shape
    score = per_group_score(choice.view(t, groups, e // groups))
    best = torch.topk(score, k=keep, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(score, dtype=torch.bool).scatter(1, best, True)
    return mask.unsqueeze(-1).expand(t, groups, e // groups).reshape(t, e)


class DeepseekMoE(SparseMoE):
    """version: 2 or 3 (the router)."""

    def __init__(self, config, prefix: str, version: int) -> None:
        super().__init__(config.hidden_size, config.moe_intermediate_size,
                         config.n_routed_experts, config.num_experts_per_tok, config.hidden_act,
                         prefix, renormalize=bool(config.norm_topk_prob), names=EXPERT_NAMES)
        self.version = version
        self.scaling = float(config.routed_scaling_factor)
        self.groups, self.topk_group = config.n_group or 1, config.topk_group or 1
        self.grouped = version == 3 or config.topk_method == "group_limited_greedy"
        self.gate.to(torch.float32)
        if version == 3:
            bias = nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32),
                                requires_grad=False)
            bias.weight_loader = copy_full
            self.gate.e_score_correction_bias = bias
        shared = (config.n_shared_experts or 0) * config.moe_intermediate_size
        self.shared_experts = GatedMLP(config.hidden_size, shared, config.hidden_act,
                                       f"{prefix}.shared_experts") if shared else None

    def route(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())
        if self.version == 2:
            scores = logits.softmax(dim=-1)
            choice = scores
            if self.grouped:
                mask = _group_mask(scores, self.groups, self.topk_group,
                                   lambda g: g.max(dim=-1).values)
                choice = scores.masked_fill(~mask, 0.0)
        else:
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias
            mask = _group_mask(choice, self.groups, self.topk_group,
                               lambda g: g.topk(2, dim=-1)[0].sum(dim=-1))
            choice = choice.masked_fill(~mask, float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        top = (choice if self.version == 2 else scores).gather(1, idx)
        if self.version == 3 and self.renormalize:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        return torch.zeros_like(scores).scatter(1, idx, top * self.scaling)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        out = super().partial(x)
        if self.shared_experts is None:
            return out
        mlp = self.shared_experts
        return out + mlp.down_proj.partial(mlp.act.project(mlp.gate_up_proj, x))
