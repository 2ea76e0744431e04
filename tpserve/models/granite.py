"""IBM Granite (GraniteForCausalLM, the dense Granite 3.x models): the Llama blocks with four
multipliers from its config. embedding_multiplier scales the embeddings (a Python float, as
transformers multiplies, not rounded to the model dtype first as Gemma's scale is);
residual_multiplier scales each attention and MLP output before it joins the residual stream;
attention_multiplier is the scores' scale in place of 1 / sqrt(head_dim); the logits are
divided by logits_scaling. attention_bias and mlp_bias as Llama's.

Fused paths: the residual add inside the norm kernel (add_rms_norm) receives a branch already
scaled (LlamaDecoderLayer._scaled), and the attention kernels take the scale from the
layer's spec. The one-row fold (LlamaModel.fold_norms) adds the MLP's output to the stream
inside down_proj's launch, which cannot scale it, so LlamaDecoderLayer.why_not_foldable
refuses it whenever residual_multiplier is not 1."""

from __future__ import annotations

import torch

from tpserve.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_positions: int) -> None:
        super().__init__(config, max_positions)
        scale = float(getattr(config, "embedding_multiplier", 1.0))
        if scale != 1.0:
            self.model.embed_scale, self.model.round_embed_scale = scale, False
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    @staticmethod
    def model_kwargs(config) -> dict:
        bias = bool(getattr(config, "attention_bias", False))
        return {"qkv_bias": bias, "o_bias": bias,
                "attn_scale": float(getattr(config, "attention_multiplier", 1.0)),
                "residual_scale": float(getattr(config, "residual_multiplier", 1.0))}

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        logits = super().compute_logits(hidden, to_first_rank)
        if logits is None or self.logits_scaling == 1.0:
            return logits
        return logits / self.logits_scaling
