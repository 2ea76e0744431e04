"""Released models' attention geometry on CUDA: the widths, head counts and head dims of
real checkpoints, cut to two layers, a narrow MLP and a small vocabulary, served with the
Triton kernels in captured decode graphs against transformers on the CPU in float32.

The fixtures' 4 heads of 16-32 never make the kernels' launch choices that depend on the
head count and head dim (8 heads a program in prefill, padded head dims, warp counts):
Phi-3-mini's 32 heads of 96 failed start-up on CUDA while every fixture passed.

Each case compiles its own kernels: about 35 s a case on an H100 with a cold Triton cache,
so within one 600 s device call run the file in two halves (-k)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_cuda_greedy_matches
from tiny_models import (
    PROMPTS,
    bloom_config,
    deepseek_v2_config,
    falcon_config,
    gemma2_config,
    gemma3_config,
    gemma_config,
    gpt_bigcode_config,
    gpt_neox_config,
    llama_config,
    phi3_config,
    phi_config,
    qwen2_config,
    qwen3_config,
    save_model,
    starcoder2_config,
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
    # Gemma 3 4B: heads of 256 with per-head q/k norms, a sliding and a global layer.
    "gemma3-4b": (gemma3_config, dict(hidden_size=2560, num_attention_heads=8,
                                      num_key_value_heads=4, head_dim=256,
                                      query_pre_attn_scalar=256, **NARROW)),
    # Rotary on part of each head: Phi-2 (32 of 80) and Pythia 1B (64 of 256).
    "phi-2": (phi_config, dict(hidden_size=2560, num_attention_heads=32, num_key_value_heads=32,
                               partial_rotary_factor=0.4, **NARROW)),
    "pythia-1b": (gpt_neox_config, dict(hidden_size=2048, num_attention_heads=8, **NARROW)),
    # Groups of 12 with a window (StarCoder2 15B) and 48 on one KV head (StarCoder).
    "starcoder2-15b": (starcoder2_config, dict(hidden_size=6144, num_attention_heads=48,
                                               num_key_value_heads=4, sliding_window=16,
                                               **NARROW)),
    "starcoder": (gpt_bigcode_config, dict(n_embd=6144, n_head=48, n_inner=256, n_layer=2,
                                           tie_word_embeddings=False)),
    # MLA (DeepSeek-V2-Lite): a latent of 512, keys of 128 + 64 rope dims, values of 128.
    "deepseek-v2-lite": (deepseek_v2_config, dict(hidden_size=2048, num_attention_heads=16,
                                                  num_key_value_heads=16, kv_lora_rank=512,
                                                  qk_nope_head_dim=128, qk_rope_head_dim=64,
                                                  v_head_dim=128, moe_intermediate_size=64,
                                                  intermediate_size=256,
                                                  num_hidden_layers=2)),
}


@pytest.mark.parametrize("name", list(GEOMETRIES))
def test_released_head_geometry_matches_transformers_on_cuda(models_dir, name):
    build, geometry = GEOMETRIES[name]
    config = build(**geometry)
    # Weights scaled to the width, so two layers keep their activations in range.
    path = save_model(config, models_dir / f"geometry-{name}",
                      std=1.0 / config.hidden_size ** 0.5 * 2)
    # One prompt past 8 tokens a prefill program.
    assert_cuda_greedy_matches(path, PROMPTS + [" ".join(PROMPTS)], 24)
