"""Released models' attention geometry on CUDA: the widths, head counts and head dims of
real checkpoints, cut to two layers, a narrow MLP and a small vocabulary, served with the
Triton kernels in captured decode graphs against transformers on the CPU in float32.

The fixtures' 4 heads of 16-32 never make the kernels' launch choices that depend on the
head count and head dim (8 heads a program in prefill, padded head dims, warp counts):
Phi-3-mini's 32 heads of 96 failed start-up on CUDA while every fixture passed."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_cuda_greedy_matches
from tiny_models import (
    PROMPTS,
    bloom_config,
    falcon_config,
    gemma2_config,
    gemma_config,
    llama_config,
    phi3_config,
    qwen2_config,
    qwen3_config,
    save_model,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

NARROW = dict(num_hidden_layers=2, intermediate_size=256)

# name: (config builder, the released model's attention geometry). Heads untied: a tied
# head of two random layers echoes the last token, which would compare nothing.
GEOMETRIES = {
    "llama3-8b": (llama_config, dict(hidden_size=4096, num_attention_heads=32,
                                     num_key_value_heads=8, **NARROW)),
    "phi3-mini": (phi3_config, dict(hidden_size=3072, num_attention_heads=32,
                                    num_key_value_heads=32, partial_rotary_factor=1.0,
                                    sliding_window=2047, **NARROW)),
    "gemma-7b": (gemma_config, dict(hidden_size=3072, num_attention_heads=16,
                                    num_key_value_heads=16, head_dim=256,
                                    tie_word_embeddings=False, **NARROW)),
    "gemma2-9b": (gemma2_config, dict(hidden_size=3584, num_attention_heads=16,
                                      num_key_value_heads=8, head_dim=256,
                                      query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                                      final_logit_softcapping=30.0, sliding_window=16,
                                      **NARROW)),
    "qwen3-8b": (qwen3_config, dict(hidden_size=4096, num_attention_heads=32,
                                    num_key_value_heads=8, head_dim=128, **NARROW)),
    # Groups of query heads that are not powers of two: 7 (Qwen2.5 7B; 5 and 6 in its other
    # sizes) and 71 on one KV head (Falcon 7B).
    "qwen2.5-7b": (qwen2_config, dict(hidden_size=3584, num_attention_heads=28,
                                      num_key_value_heads=4, **NARROW)),
    "falcon-7b": (falcon_config, dict(hidden_size=4544, num_attention_heads=71,
                                      ffn_hidden_size=256, num_hidden_layers=2)),
    "bloom-560m": (bloom_config, dict(hidden_size=1024, n_head=16, n_layer=2,
                                      tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_released_head_geometry_matches_transformers_on_cuda(models_dir, name):
    build, geometry = GEOMETRIES[name]
    # Weights scaled to the width, so two layers keep their activations in range.
    path = save_model(build(**geometry), models_dir / f"geometry-{name}",
                      std=1.0 / geometry["hidden_size"] ** 0.5 * 2)
    # One prompt past 8 tokens a prefill program.
    assert_cuda_greedy_matches(path, PROMPTS + [" ".join(PROMPTS)], 24)
