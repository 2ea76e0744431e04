"""The outer module shared by the families written apart from LlamaForCausalLM, whose norms
are LayerNorms (Bloom, GPT-NeoX, GPTBigCode): the decoder under the checkpoint's own name
and a vocabulary-parallel LM head, tied to the decoder's token embedding unless the config
unties it. Each family keeps its own forward and loader."""

from __future__ import annotations

import torch
from torch import nn

from tpserve.layers.embedding import ParallelLMHead


class LayerNormCausalLM(nn.Module):
    # Subclasses: transformers' default for tie_word_embeddings in the family's config class,
    # and the checkpoint's name of the head.
    tied_by_default = True
    head_name = "lm_head"

    def __init__(self, config, body_name: str, body: nn.Module, embedding: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.add_module(body_name, body)
        head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.add_module(self.head_name, head)
        if self.tied(config):
            head.tie_to(embedding)

    @classmethod
    def tied(cls, config) -> bool:
        return bool(getattr(config, "tie_word_embeddings", cls.tied_by_default))

    def fold_norms(self, need_gemv: bool = True) -> str | None:
        """Never folds (the worker logs why): a LayerNorm's mean and bias do not fold into
        the projection after it, as an RMSNorm's weight does."""
        return "its norms are LayerNorms: only an RMSNorm folds"

    def compute_logits(self, hidden: torch.Tensor, to_first_rank: bool = False
                       ) -> torch.Tensor | None:
        """to_first_rank: logits on tp rank 0 only, None elsewhere (ParallelLMHead)."""
        return getattr(self, self.head_name).compute_logits(hidden, to_first_rank)
