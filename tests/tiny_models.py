"""Tiny random checkpoints of each supported family, built with transformers' own config
classes and saved as safetensors, plus a byte-level BPE tokenizer trained on the spot.
Nothing is downloaded."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Tensor parallel inference splits every layer across devices.",
    "A paged cache stores keys and values in fixed size blocks.",
    "Hello world, this is a tiny model trained on nothing at all.",
    "Ray actors hold one shard each and all-reduce after row parallel layers.",
    "Once upon a time there was a server that answered every request.",
    "Numbers like 12345 and 67890 and symbols like {} [] () are tokens too.",
] * 20

PROMPTS = [
    "The quick brown fox",
    "Hello world",
    "Ray actors hold one shard each and all-reduce after row parallel layers, and a paged cache",
    "A",
]


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")


def _common(vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def llama_config(**kw):
    from transformers import LlamaConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = LlamaConfig(**args)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def mistral_config(**kw):
    from transformers import MistralConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                sliding_window=8, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = MistralConfig(**args)
    cfg.architectures = ["MistralForCausalLM"]
    return cfg


def mixtral_config(**kw):
    """4 experts, 2 per token, each expert's intermediate 128 split across up to 4 ranks;
    GQA (4 heads, 2 KV heads)."""
    from transformers import MixtralConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=512, tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = MixtralConfig(**args)
    cfg.architectures = ["MixtralForCausalLM"]
    return cfg


def gemma_config(**kw):
    """Multi-query (one KV head) and head_dim 32 != hidden / heads = 16; tied head."""
    from transformers import GemmaConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                max_position_embeddings=512, hidden_act="gelu_pytorch_tanh",
                tie_word_embeddings=True, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = GemmaConfig(**args)
    cfg.architectures = ["GemmaForCausalLM"]
    return cfg


def gemma2_config(**kw):
    """GQA (4 heads, 2 KV heads), head_dim 32, scores scaled by query_pre_attn_scalar 24
    (not head_dim) and capped low enough to bite (attention 3.0, final logits 10.0), a window
    of 8 on the first of the two layers (layer_types alternate). Untied: with the tied head
    of the released models, two layers whose outputs are normed to unit size next to the
    embedding scaled by sqrt(hidden) only echo the last token (the Gemma checkpoint covers
    the tied head). Each of the four shows in the prompt's last logits by 0.19-3.4."""
    from transformers import Gemma2Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
                final_logit_softcapping=10.0, sliding_window=8, max_position_embeddings=512,
                hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Gemma2Config(**args)
    cfg.architectures = ["Gemma2ForCausalLM"]
    return cfg


def gemma3_config(**kw):
    """Gemma 3 text: GQA, head_dim 32, query_pre_attn_scalar 24, (1 + w) norms on each head's
    query and key, a window of 8 on the first layer whose rotary has a base of its own
    (10,000) while the global layer's is linear-scaled (factor 8, base 1e6), as released.
    Untied, as gemma2_config, so the continuations do not just echo."""
    from transformers import Gemma3TextConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                query_pre_attn_scalar=24, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0,
                                       "rope_theta": 1000000.0}},
                max_position_embeddings=512, hidden_activation="gelu_pytorch_tanh",
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Gemma3TextConfig(**args)
    cfg.architectures = ["Gemma3ForCausalLM"]
    return cfg


def gemma3_vlm_config(**kw):
    """A vision-language Gemma 3 (Gemma3ForConditionalGeneration, as gemma-3-4b and up) whose
    language model is gemma3_config's and whose vision tower is a one-layer SigLIP; served as
    text only. Untied (the outer config decides), as gemma3_config."""
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    cfg = Gemma3Config(text_config=gemma3_config(**kw).to_dict(),
                       vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       tie_word_embeddings=False)
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    return cfg


# Vision towers of the tiny vision-language checkpoints: one small layer each (served as
# text only, they are saved and never read; transformers builds them when it runs the model).
def _pixtral_vision():
    from transformers import PixtralVisionConfig

    return PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, head_dim=16, image_size=28,
                               patch_size=14).to_dict()


def _clip_vision():
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, image_size=28, patch_size=14,
                            projection_dim=32).to_dict()


def mistral3_vlm_config(**kw):
    """Mistral Small 3.1 / 3.2 (Mistral3ForConditionalGeneration): a Mistral language model
    with head_dim 32 != 64 / 4 (as the released 128 != 5120 / 32) and mistral_config's window
    of 8, a one-layer Pixtral vision tower and the patch-merging projector. Untied, as
    released (tie_word_embeddings false on the outer config, which Mistral3Config defaults
    to true)."""
    from transformers import Mistral3Config

    cfg = Mistral3Config(text_config=mistral_config(head_dim=32, **kw).to_dict(),
                         vision_config=_pixtral_vision(), tie_word_embeddings=False)
    cfg.architectures = ["Mistral3ForConditionalGeneration"]
    return cfg


def llava_config(text, next_: bool = False, **kw):
    """LLaVA (LlavaForConditionalGeneration) or LLaVA-NeXT (next_: LlavaNextForConditional-
    Generation, with its image_newline) over the language model text(**kw) (llama_config,
    mistral_config or qwen2_config), with a one-layer CLIP vision tower; untied."""
    from transformers import LlavaConfig, LlavaNextConfig

    language = text(**kw)
    if next_:
        cfg = LlavaNextConfig(text_config=language.to_dict(), vision_config=_clip_vision(),
                              image_grid_pinpoints=[[28, 56]],
                              tie_word_embeddings=language.tie_word_embeddings)
    else:
        cfg = LlavaConfig(text_config=language.to_dict(), vision_config=_clip_vision(),
                          image_seq_length=4, tie_word_embeddings=language.tie_word_embeddings)
    cfg.architectures = ["LlavaNextForConditionalGeneration" if next_
                         else "LlavaForConditionalGeneration"]
    return cfg


def qwen2_vl_config(v2_5: bool = False, **kw):
    """Qwen2-VL (or Qwen2.5-VL: v2_5) with Qwen2's language model (q/k/v biases, GQA 4 / 2,
    head_dim 16) under multimodal rotary: mrope_section [2, 3, 3] (the released 16, 24, 24
    scaled to head_dim / 2 = 8 frequencies), rope_theta 1e6 as released; a one-layer vision
    tower. Untied unless kw says otherwise (Qwen2-VL-2B and Qwen2.5-VL-3B tie)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    tied = kw.pop("tie_word_embeddings", False)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                                 "mrope_section": [2, 3, 3]},
                **_common(kw.pop("vocab_size", 301)))
    text.update(kw)
    vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
    if v2_5:
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                      out_hidden_size=64, fullatt_block_indexes=[0])
    # Image and video tokens past the tokenizer's ids: text never holds them.
    ids = dict(image_token_id=301, video_token_id=302, vision_start_token_id=303,
               vision_end_token_id=304)
    cls = Qwen2_5_VLConfig if v2_5 else Qwen2VLConfig
    cfg = cls(text_config=text, vision_config=vision, tie_word_embeddings=tied, **ids)
    cfg.architectures = ["Qwen2_5_VLForConditionalGeneration" if v2_5
                         else "Qwen2VLForConditionalGeneration"]
    return cfg


def bloom_config(**kw):
    """4 heads (one per rank at tp = 4), ALiBi, tied head."""
    from transformers import BloomConfig

    args = dict(hidden_size=64, n_layer=2, n_head=4, tie_word_embeddings=True,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = BloomConfig(**args)
    cfg.architectures = ["BloomForCausalLM"]
    return cfg


def qwen2_config(**kw):
    from transformers import Qwen2Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Qwen2Config(**args)
    cfg.architectures = ["Qwen2ForCausalLM"]
    return cfg


def qwen3_config(**kw):
    """No biases, an RMSNorm on each head's query and key; GQA, head_dim 32 != 64 / 4, and
    a window of 8 on the second layer (use_sliding_window from max_window_layers = 1)."""
    from transformers import Qwen3Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, use_sliding_window=True, sliding_window=8,
                max_window_layers=1, tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Qwen3Config(**args)
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def qwen3_moe_config(**kw):
    """Qwen3-MoE: 8 experts of 32 (8 a rank at tp = 4), 3 per token, renormalised
    (norm_topk_prob, as released); layer 1 dense (mlp_only_layers, intermediate 96) between
    two sparse ones; GQA, head_dim 32 != 64 / 4, per-head q/k norms; a window of 8 on every
    layer (use_sliding_window: transformers windows all of this family's layers)."""
    from transformers import Qwen3MoeConfig

    args = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=3,
                norm_topk_prob=True, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                use_sliding_window=True, sliding_window=8, max_position_embeddings=512,
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Qwen3MoeConfig(**args)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    return cfg


def qwen2_moe_config(**kw):
    """Qwen2-MoE: 6 experts of 32, 2 per token, not renormalised (norm_topk_prob off, as
    released), a shared expert of 64 behind its sigmoid gate; sparse on every second layer
    (decoder_sparse_step 2: layers 1 and 3; 0 and 2 dense of 96); q/k/v biases; GQA and
    head_dim 32 != 64 / 4."""
    from transformers import Qwen2MoeConfig

    args = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                shared_expert_intermediate_size=64, num_hidden_layers=4, decoder_sparse_step=2,
                num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Qwen2MoeConfig(**args)
    cfg.architectures = ["Qwen2MoeForCausalLM"]
    return cfg


def phi3_config(**kw):
    """Fused qkv_proj / gate_up_proj on disk; GQA (4 heads, 2 KV heads); half-rotary heads
    (partial_rotary_factor 0.5, as Phi-4-mini uses 0.75)."""
    from transformers import Phi3Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                original_max_position_embeddings=512, partial_rotary_factor=0.5,
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Phi3Config(**args)
    cfg.architectures = ["Phi3ForCausalLM"]
    return cfg


def granite_config(**kw):
    """Granite's four multipliers away from one (embeddings x12, each branch x0.22 before
    the residual add, scores x0.015625 in place of 1 / sqrt(16) = 0.25, logits / 8), biases
    on attention and the MLP (attention_bias, mlp_bias; off in the released models), GQA."""
    from transformers import GraniteConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                embedding_multiplier=12.0, residual_multiplier=0.22,
                attention_multiplier=0.015625, logits_scaling=8.0, attention_bias=True,
                mlp_bias=True, tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = GraniteConfig(**args)
    cfg.architectures = ["GraniteForCausalLM"]
    return cfg


def granite_moe_config(**kw):
    """GraniteMoE: granite_config's four multipliers and attention biases with 4 experts of
    64 (16 a rank at tp = 4), 2 per token, stored fused (input_linear [4, 128, 64] with gate
    before up, output_linear [4, 64, 64]); GQA (4 heads, 2 KV heads)."""
    from transformers import GraniteMoeConfig

    args = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, max_position_embeddings=512,
                embedding_multiplier=12.0, residual_multiplier=0.22,
                attention_multiplier=0.015625, logits_scaling=8.0, attention_bias=True,
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = GraniteMoeConfig(**args)
    cfg.architectures = ["GraniteMoeForCausalLM"]
    return cfg


def starcoder2_config(**kw):
    """LayerNorm with a bias, biases on q/k/v/o and the plain c_fc -> tanh GELU -> c_proj
    MLP (use_bias), GQA (4 heads, 2 KV heads), a window of 8 on every layer (shorter than
    the long prompt and every prompt + 32 new tokens), untied (tied_starcoder2: tied)."""
    from transformers import Starcoder2Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                sliding_window=8, use_bias=True, norm_epsilon=1e-5,
                hidden_act="gelu_pytorch_tanh", tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Starcoder2Config(**args)
    cfg.architectures = ["Starcoder2ForCausalLM"]
    return cfg


def gpt_neox_config(**kw):
    """GPT-NeoX / Pythia: per-head fused query_key_value (4 heads of 16, one per rank at
    tp = 4), rotary on a quarter of each head (rotary_pct 0.25, as Pythia), LayerNorms and
    a plain MLP with biases, exact GELU, untied embed_out; use_parallel_residual as given
    (Pythia's and 20B's default True; gpt-neox-sequential: False)."""
    from transformers import GPTNeoXConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=512, rotary_pct=0.25,
                hidden_act="gelu", use_parallel_residual=True, tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = GPTNeoXConfig(**args)
    cfg.architectures = ["GPTNeoXForCausalLM"]
    return cfg


def phi_config(**kw):
    """Phi-2: biases on q/k/v/dense, fc1/fc2 and the LM head, rotary on half of each head
    (partial_rotary_factor 0.5), one LayerNorm feeding attention and MLP in parallel,
    gelu_new; GQA (4 heads, 2 KV heads: transformers' Phi takes num_key_value_heads)."""
    from transformers import PhiConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                partial_rotary_factor=0.5, hidden_act="gelu_new", tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = PhiConfig(**args)
    cfg.architectures = ["PhiForCausalLM"]
    return cfg


def olmo2_config(**kw):
    """OLMo 2: norms after attention and after the MLP (none before), q_norm / k_norm over
    every head's query (64 wide) and key (32 wide); GQA (4 heads, 2 KV heads of 16), so at
    tp = 4 each KV head and its slice of k_norm sit on two ranks."""
    from transformers import Olmo2Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Olmo2Config(**args)
    cfg.architectures = ["Olmo2ForCausalLM"]
    return cfg


def gpt_bigcode_config(**kw):
    """StarCoder / SantaCoder: multi-query attention (4 heads of 16, one KV head, replicated
    on every rank) with c_attn fused [q; k; v] (gpt-bigcode-mha: multi_query False, rows
    per head), learned positions wpe, LayerNorms and a plain MLP with biases, tanh GELU,
    tied head; n_inner 128 (not 4 x hidden)."""
    from transformers import GPTBigCodeConfig

    args = dict(n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=512,
                multi_query=True, activation_function="gelu_pytorch_tanh",
                tie_word_embeddings=True, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = GPTBigCodeConfig(**args)
    cfg.architectures = ["GPTBigCodeForCausalLM"]
    return cfg


def cohere_config(**kw):
    """Command-R: one bias-free LayerNorm feeding attention and a gated SiLU MLP in parallel,
    rotary over interleaved pairs, GQA (4 heads, 2 KV heads of 16: replicated at tp = 4),
    logits x logit_scale 0.5, tied head (the family's default); cohere-qk-norm adds
    Command-R+'s per-head LayerNorms (a weight per head) on queries and keys."""
    from transformers import CohereConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                logit_scale=0.5, layer_norm_eps=1e-5, tie_word_embeddings=True,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = CohereConfig(**args)
    cfg.architectures = ["CohereForCausalLM"]
    return cfg


def cohere2_config(**kw):
    """Command R7B / Command A: Cohere's layer on 4 layers, the first three sliding (window
    8, rotary) and the fourth full attention without any positional embedding (transformers'
    sliding_window_pattern 4); GQA as cohere_config, q/k/v/o biases (attention_bias) to show
    each is added once, tied head, logit_scale 0.5."""
    from transformers import Cohere2Config

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                sliding_window=8, logit_scale=0.5, attention_bias=True,
                tie_word_embeddings=True, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Cohere2Config(**args)
    cfg.architectures = ["Cohere2ForCausalLM"]
    return cfg


def gpt_oss_config(**kw):
    """GPT-OSS: 4 heads of 16, 2 KV heads (replicated at tp = 4), q/k/v/o biases, attention
    sinks, three layers windowed / full / windowed (layer_types) with a window of 8 (the
    prompts are longer), YaRN rotary; 8 experts of 64 (16 a rank at tp = 4), 2 per token,
    with a biased router and the clamped SwiGLU at a limit of 1.5, low enough that the
    random weights reach it (where transformers reads the limit from the config; before
    that it used 7.0 and 1.702 whatever the config said, so the model keeps those there)."""
    from transformers import GptOssConfig

    limit = 1.5 if hf_reads_swiglu_config() else 7.0
    args = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=3, head_dim=16,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
                swiglu_limit=limit, tie_word_embeddings=False,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                 "original_max_position_embeddings": 128},
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = GptOssConfig(**args)
    cfg.architectures = ["GptOssForCausalLM"]
    return cfg


@functools.cache
def hf_reads_swiglu_config() -> bool:
    """Whether the installed transformers' GPT-OSS experts take swiglu_limit and
    swiglu_alpha from the config (transformers 5.17 hard-codes 7.0 and 1.702)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=8, intermediate_size=8, num_local_experts=2,
                       swiglu_limit=1.5, swiglu_alpha=1.25)
    experts = GptOssExperts(cfg)
    return experts.limit == 1.5 and experts.alpha == 1.25


def deepseek_v2_config(**kw):
    """DeepSeek-V2(-Lite): MLA with queries from q_proj (no q_lora_rank), a latent of 32
    expanded to 4 heads of nope 16 + rope 8 keys and values of 16 (v narrower than the
    keys); layer 0 dense (first_k_dense_replace 1), then 8 experts of 32 in 2 groups, 2 per
    token from the group of the best softmax score (group_limited_greedy), times
    routed_scaling_factor 2.0, beside 2 shared experts (one MLP of 64)."""
    from transformers import DeepseekV2Config

    args = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                n_group=2, topk_group=1, topk_method="group_limited_greedy",
                routed_scaling_factor=2.0, first_k_dense_replace=1, norm_topk_prob=False,
                max_position_embeddings=512, tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = DeepseekV2Config(**args)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return cfg


# DeepSeek-V3's YaRN, scaled down: mscale == mscale_all_dim leaves cos/sin unscaled while
# the softmax scale gains mscale_all_dim's mscale squared, as the released config does.
DEEPSEEK_V3_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                    "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1,
                    "mscale": 1.0, "mscale_all_dim": 1.0}


def deepseek_v3_config(**kw):
    """DeepSeek-V3 / R1: low-rank queries (q_a_proj 48 -> q_a_layernorm -> q_b_proj), MLA as
    deepseek_v2_config; layer 0 dense, then 8 experts of 32 in 4 groups: sigmoid scores plus
    e_score_correction_bias (random in the saved checkpoint) choose 2 experts from the best
    2 groups (noaux_tc), weighted by the unbiased scores renormalised (norm_topk_prob) times
    routed_scaling_factor 2.5, beside one shared expert; YaRN rope (DEEPSEEK_V3_YARN)."""
    from transformers import DeepseekV3Config

    args = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                first_k_dense_replace=1, rope_parameters=dict(DEEPSEEK_V3_YARN),
                max_position_embeddings=512, tie_word_embeddings=False,
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = DeepseekV3Config(**args)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    return cfg


def llama4_config(**kw):
    """Llama 4 text: 4 layers, RoPE / RoPE / NoPE / RoPE (no_rope_layer_interval 3) and dense /
    experts / dense / experts (interleave_moe_layer_step 2, as Maverick); 4 heads of 16, 2 KV
    heads (replicated at tp = 4); the RoPE layers' L2 qk norm and chunks of 8 positions (the
    longer prompts and the continuations cross chunks); on the NoPE layer the temperature
    tuning with floor_scale 4 and attn_scale 0.3 so the query scales grow within the test's
    positions; llama3 rope; 4 experts of 64 (16 a rank at tp = 4), one per token, a shared
    expert, dense layers of intermediate_size_mlp 128."""
    from transformers import Llama4TextConfig

    args = dict(hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                num_local_experts=4, num_experts_per_tok=1, no_rope_layer_interval=3,
                interleave_moe_layer_step=2, attention_chunk_size=8, floor_scale=4,
                attn_scale=0.3, max_position_embeddings=512, tie_word_embeddings=False,
                rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64},
                **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = Llama4TextConfig(**args)
    cfg.architectures = ["Llama4ForCausalLM"]
    return cfg


def llama4_vlm_config(**kw):
    """Llama4ForConditionalGeneration around llama4_config(**kw), a one-layer vision tower."""
    from transformers import Llama4Config, Llama4VisionConfig

    vision = Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=64, image_size=28, patch_size=14,
                                vision_output_dim=32, projector_input_dim=32,
                                projector_output_dim=32)
    cfg = Llama4Config(text_config=llama4_config(**kw).to_dict(),
                       vision_config=vision.to_dict())
    cfg.architectures = ["Llama4ForConditionalGeneration"]
    return cfg


def nemotron_config(**kw):
    """Nemotron: LayerNorm1P ((1 + w), with a bias), a plain up_proj -> relu2 -> down_proj
    MLP, GQA (4 heads, 2 KV heads, replicated at tp = 4) with head_dim 32 != 64 / 4 and
    rotary on half of each head (partial_rotary_factor 0.5), biases on q/k/v/o and the MLP
    (nemotron-no-bias: none, tied head), untied."""
    from transformers import NemotronConfig

    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, norm_eps=1e-5, hidden_act="relu2",
                partial_rotary_factor=0.5, attention_bias=True, mlp_bias=True,
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = NemotronConfig(**args)
    cfg.architectures = ["NemotronForCausalLM"]
    return cfg


def falcon_config(**kw):
    """Falcon-7B's layer: multi_query (4 heads of 16, one KV head replicated on every rank;
    query_key_value rows [q; k; v]), parallel_attn (one input_layernorm feeding attention and
    MLP), rotary, no biases, GELU MLP of ffn_hidden_size 128, untied head. falcon-40b*:
    new_decoder_architecture, GQA (2 KV heads: query_key_value rows per KV group [q, q, k,
    v], a KV head on two ranks at tp = 4), ln_attn / ln_mlp (num_ln_in_parallel_attn 2) or
    one input_layernorm (1), rope_theta 5e4, tied; falcon-rw: ALiBi, per-head
    [head, (q, k, v)] rows, sequential (post_attention_layernorm), biases everywhere."""
    from transformers import FalconConfig

    args = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                ffn_hidden_size=128, multi_query=True, parallel_attn=True, alibi=False,
                bias=False, new_decoder_architecture=False, max_position_embeddings=512,
                tie_word_embeddings=False, **_common(kw.pop("vocab_size", 301)))
    args.update(kw)
    cfg = FalconConfig(**args)
    cfg.architectures = ["FalconForCausalLM"]
    return cfg


def falcon_40b_config(**kw):
    args = dict(new_decoder_architecture=True, num_kv_heads=2, num_ln_in_parallel_attn=2,
                rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                tie_word_embeddings=True)
    args.update(kw)
    return falcon_config(**args)


def falcon_rw_config(**kw):
    args = dict(alibi=True, multi_query=False, parallel_attn=False, bias=True,
                tie_word_embeddings=True)
    args.update(kw)
    return falcon_config(**args)


def phi3_longrope_config(original: int = 32, max_positions: int = 256,
                         short=(1.0, 2.0, 4.0, 8.0), long=(3.0, 6.0, 12.0, 24.0)):
    """phi3_config with longrope scaling (Phi-3-*-128k, Phi-3.5, Phi-4-mini) over a small
    original context: head_dim 16 at partial_rotary_factor 0.5, 4 frequencies, one factor
    each; the attention factor sqrt(1 + ln(max / original) / ln(original)) scales both sets."""
    return phi3_config(
        rope_scaling={"type": "longrope", "short_factor": list(short), "long_factor": list(long)},
        original_max_position_embeddings=original, max_position_embeddings=max_positions)


def save_model(config, out: Path, seed: int = 0, vocab_for_tokenizer: int | None = None,
               vector_std: float = 0.0, std: float = 0.08, save_dtype: torch.dtype | None = None,
               max_shard_size: str | None = None, buffer_std: float = 0.0) -> Path:
    """Instantiate transformers' model for config with random weights and save it with a
    tokenizer; returns the directory. vector_std > 0 also perturbs 1-D parameters (biases,
    norm weights), which transformers initialises to constants that would hide bugs.
    save_dtype: the weights (and config.json's dtype) in that dtype; max_shard_size: split
    into several files with a model.safetensors.index.json, as large checkpoints are.
    buffer_std > 0 also perturbs the saved float buffers (DeepSeek-V3's router bias, zero
    as transformers initialises it)."""
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    model = auto_class(config.to_dict()).from_config(config, dtype=torch.float32)
    # Spread the random weights so greedy continuations are not all one token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, std)
            elif vector_std:
                p.add_(torch.randn_like(p) * vector_std)
        params = {n for n, _ in model.named_parameters()}
        for n, b in model.state_dict().items():
            if buffer_std and n not in params and b.is_floating_point():
                b.add_(torch.randn_like(b) * buffer_std)
    if save_dtype is not None:
        model = model.to(save_dtype)
    shards = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, safe_serialization=True, **shards)
    text = config.get_text_config()  # the language model's (a vision-language config nests it)
    tok = build_tokenizer(min(vocab_for_tokenizer or text.vocab_size, text.vocab_size))
    tok.save_pretrained(out)
    gen = out / "generation_config.json"
    if gen.exists():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = text.eos_token_id
        gen.write_text(json.dumps(g))
    return out


# Checkpoints of the families added after Llama: name -> (config builder, save_model kwargs).
# Larger weights than the default keep the tied-head families' greedy continuations from
# collapsing onto one token; vector_std perturbs biases and norm weights so that, e.g., a
# bias added tp times or Gemma's (1 + w) norm would show.
FAMILY_CHECKPOINTS = {
    "gemma": (gemma_config, {"std": 0.3, "vector_std": 0.1}),
    "gemma2": (gemma2_config, {"std": 0.3, "vector_std": 0.1}),
    "gemma3": (gemma3_config, {"std": 0.3, "vector_std": 0.1}),
    "gemma3-vlm": (gemma3_vlm_config, {"std": 0.3, "vector_std": 0.1}),
    # Vision-language checkpoints served as text (tests/test_vlm_text_only.py), saved as
    # transformers saves them: the published names (language_model.model.* ...; Qwen2-VL's
    # model.*, visual.*).
    "mistral3": (mistral3_vlm_config, {"std": 0.3, "vector_std": 0.1}),
    "llava-llama": (lambda: llava_config(llama_config), {"std": 0.3, "vector_std": 0.1}),
    "llava-qwen2": (lambda: llava_config(qwen2_config), {"std": 0.3, "vector_std": 0.1}),
    "llava-next-mistral": (lambda: llava_config(mistral_config, next_=True),
                           {"std": 0.3, "vector_std": 0.1}),
    "qwen2-vl": (qwen2_vl_config, {"std": 0.3, "vector_std": 0.1}),
    "qwen2.5-vl-tied": (lambda: qwen2_vl_config(v2_5=True, tie_word_embeddings=True),
                        {"std": 0.3, "vector_std": 0.1}),
    "bloom": (bloom_config, {"std": 0.5, "vector_std": 0.1}),
    "qwen2": (qwen2_config, {"vector_std": 0.1}),
    "qwen2-tied": (lambda: qwen2_config(tie_word_embeddings=True),
                   {"std": 0.3, "vector_std": 0.1}),
    "phi3": (phi3_config, {}),
    "mixtral": (mixtral_config, {"std": 0.2, "vector_std": 0.1}),
    "qwen3": (qwen3_config, {"std": 0.3, "vector_std": 0.1}),
    "granite": (granite_config, {"std": 0.5, "vector_std": 0.1}),
    # Granite whose norms fold (tests/test_norm_fold.py): no residual multiplier and no MLP
    # bias (either refuses the fold); the other three multipliers still bite.
    "granite-fold": (lambda: granite_config(residual_multiplier=1.0, mlp_bias=False),
                     {"std": 0.5, "vector_std": 0.1}),
    "starcoder2": (starcoder2_config, {"std": 0.3, "vector_std": 0.1}),
    "starcoder2-tied": (lambda: starcoder2_config(tie_word_embeddings=True),
                        {"std": 0.3, "vector_std": 0.1}),
    "qwen3-moe": (qwen3_moe_config, {"std": 0.3, "vector_std": 0.1}),
    "qwen2-moe": (qwen2_moe_config, {"std": 0.3, "vector_std": 0.1}),
    "gpt-neox": (gpt_neox_config, {"std": 0.3, "vector_std": 0.1}),
    "gpt-neox-sequential": (lambda: gpt_neox_config(use_parallel_residual=False),
                            {"std": 0.3, "vector_std": 0.1}),
    "phi": (phi_config, {"std": 0.3, "vector_std": 0.1}),
    # A LayerNorm over each head's query and key (off in the released Phi models).
    "phi-qk-norm": (lambda: phi_config(qk_layernorm=True), {"std": 0.3, "vector_std": 0.1}),
    "olmo2": (olmo2_config, {"std": 0.5, "vector_std": 0.1}),
    "granite-moe": (granite_moe_config, {"std": 0.5, "vector_std": 0.1}),
    "gpt-bigcode": (gpt_bigcode_config, {"std": 0.3, "vector_std": 0.1}),
    "gpt-bigcode-mha": (lambda: gpt_bigcode_config(multi_query=False),
                        {"std": 0.3, "vector_std": 0.1}),
    "cohere": (cohere_config, {"std": 0.3, "vector_std": 0.1}),
    "cohere-qk-norm": (lambda: cohere_config(use_qk_norm=True), {"std": 0.3, "vector_std": 0.1}),
    "cohere2": (cohere2_config, {"std": 0.3, "vector_std": 0.1}),
    # vector_std 1.0: sinks (1-D) large enough to take a visible share of each softmax.
    "gpt-oss": (gpt_oss_config, {"std": 0.3, "vector_std": 1.0}),
    "deepseek-v2": (deepseek_v2_config, {"std": 0.3, "vector_std": 0.1}),
    "deepseek-v3": (deepseek_v3_config, {"std": 0.3, "vector_std": 0.1, "buffer_std": 0.1}),
    "llama4": (llama4_config, {"std": 0.3, "vector_std": 0.1}),
    "falcon": (falcon_config, {"std": 0.3, "vector_std": 0.1}),
    "falcon-40b": (falcon_40b_config, {"std": 0.3, "vector_std": 0.1}),
    "falcon-40b-one-ln": (lambda: falcon_40b_config(num_ln_in_parallel_attn=1),
                          {"std": 0.3, "vector_std": 0.1}),
    "falcon-rw": (falcon_rw_config, {"std": 0.3, "vector_std": 0.1}),
    "llama4-vlm": (llama4_vlm_config, {"std": 0.3, "vector_std": 0.1}),
    "nemotron": (nemotron_config, {"std": 0.3, "vector_std": 0.1}),
    "nemotron-no-bias": (lambda: nemotron_config(attention_bias=False, mlp_bias=False,
                                                 tie_word_embeddings=True),
                         {"std": 0.3, "vector_std": 0.1}),
}


def auto_class(config: dict):
    """transformers' Auto class for a config (as a dict): seq2seq, causal LM, or for the
    vision-language models transformers does not list as causal LMs (LLaVA, Mistral 3,
    Qwen2-VL) image-text-to-text, which runs them on text alone too."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSeq2SeqLM,
    )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if config.get("is_encoder_decoder"):
        return AutoModelForSeq2SeqLM
    # Llama 4's model_type maps to the text-only causal LM too: a checkpoint with a vision
    # config is the whole vision-language model.
    if config.get("model_type") in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES \
            and "vision_config" not in config:
        return AutoModelForCausalLM
    return AutoModelForImageTextToText


def family_checkpoint(models_dir: Path, name: str) -> Path:
    """The tiny checkpoint of a family under models_dir, saved on first use (test modules
    of one session share it)."""
    out = models_dir / name
    if not (out / "config.json").exists():
        config, kwargs = FAMILY_CHECKPOINTS[name]
        save_model(config(), out, **kwargs)
    return out


def oracle_kwargs(path: Path) -> dict:
    """from_pretrained arguments of an oracle: float32, and eager attention where the
    checkpoint caps attention logits (Gemma 2): transformers 4.x loads such a model with
    SDPA by default, which leaves the cap out (its logits differed by 2.0 of 5.6 on the tiny
    Gemma 2 under 4.57.6); transformers 5 refuses SDPA there and runs eager anyway."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    eager = bool(cfg.get("attn_logit_softcapping") or text.get("attn_logit_softcapping"))
    return {"dtype": torch.float32, **({"attn_implementation": "eager"} if eager else {})}


def hf_greedy(path: Path, prompts: list[str], max_new_tokens: int,
              use_cache: bool = True) -> list[list[int]]:
    """transformers' own greedy continuation, float32 on the CPU: the oracle. use_cache=False:
    every step recomputes the whole sequence (the model alone, without generate's cache)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    cfg = json.loads((Path(path) / "config.json").read_text())
    model = auto_class(cfg).from_pretrained(path, **oracle_kwargs(path)).eval()
    outs = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.pad_token_id,
                                 min_new_tokens=max_new_tokens, use_cache=use_cache)
        outs.append(gen[0, ids.shape[1]:].tolist() if not cfg.get("is_encoder_decoder")
                    else gen[0, 1:].tolist())
    return outs


def hf_greedy_ids(path: Path, prompts: list[list[int]], news: list[int],
                  use_cache: bool = True) -> list[list[int]]:
    """hf_greedy of token-id prompts (a decoder-only model), news[i] new tokens for prompt i:
    each run alone, as generate() runs one prompt. use_cache=False: every step recomputes
    the whole sequence (for longrope, the rule without generate's cache drop at the crossing:
    transformers 5.17's drop recomputed only the last token there)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **oracle_kwargs(path)).eval()
    outs = []
    for ids, n in zip(prompts, news, strict=True):
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=2,
                                 use_cache=use_cache)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def hf_last_logits(path: Path, prompts: list[str]) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    cfg = json.loads((Path(path) / "config.json").read_text())
    model = auto_class(cfg).from_pretrained(path, **oracle_kwargs(path)).eval()
    res = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            res.append(model(ids).logits[0, -1].float())
    return res


def hf_first_step_logits(path, prompts: list[str]) -> list[torch.Tensor]:
    """transformers' logits for the first decoder token (after decoder_start_token_id)."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSeq2SeqLM.from_pretrained(path, dtype=torch.float32).eval()
    start = torch.tensor([[model.config.decoder_start_token_id]])
    out = []
    for p in prompts:
        with torch.no_grad():
            out.append(model(input_ids=tok(p, return_tensors="pt").input_ids,
                             decoder_input_ids=start).logits[0, -1].float())
    return out


def t5_config(flan: bool = True, **kw):
    """T5ForConditionalGeneration. flan=True: v1.1/Flan style (gated-gelu, an lm_head of its
    own, no output scaling; 4 heads, few buckets and max_distance 24 so long prompts reach
    the saturated buckets). flan=False: original style (relu, head tied to the embedding,
    decoder output scaled by d_model ** -0.5; 8 heads of 8 so heads * d_kv = 64 != d_model
    = 48, and 3 encoder layers against 2 decoder layers). Save with save_t5_model."""
    from transformers import T5Config

    common = _common(kw.pop("vocab_size", 301))
    del common["bos_token_id"]  # T5 has no bos; the decoder starts from pad
    if flan:
        args = dict(d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=2,
                    num_heads=4, relative_attention_num_buckets=16,
                    relative_attention_max_distance=24, feed_forward_proj="gated-gelu",
                    tie_word_embeddings=False)
    else:
        args = dict(d_model=48, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2,
                    num_heads=8, feed_forward_proj="relu")
    args.update(common, decoder_start_token_id=common["pad_token_id"], n_positions=512,
                dropout_rate=0.0)
    args.update(kw)
    cfg = T5Config(**args)
    cfg.architectures = ["T5ForConditionalGeneration"]
    return cfg


def save_t5_model(config, out: Path, seed: int = 0) -> Path:
    """save_model for a t5_config(). transformers >= 5 always ties T5's head in memory and
    saves only `shared`; a Flan-style config then gets a random lm_head.weight of its own
    and a config.json saying tie_word_embeddings: false, as the released Flan-T5 has."""
    from safetensors.torch import load_file, save_file

    # Without 1/sqrt(d) scaling the residual stream stays near the token's own embedding
    # at small weights, and greedy decoding repeats one token; std 0.5 gives varied text.
    save_model(config, out, seed=seed, vector_std=0.1, std=0.5)
    if not getattr(config, "scale_decoder_outputs", True):
        weights = load_file(out / "model.safetensors")
        gen = torch.Generator().manual_seed(seed + 1)
        weights["lm_head.weight"] = torch.randn(weights["shared.weight"].shape,
                                                generator=gen) * 0.08
        save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
        cfg = json.loads((out / "config.json").read_text())
        cfg["tie_word_embeddings"] = False
        cfg.pop("scale_decoder_outputs", None)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
