"""Checkpoints shaped unlike the fixtures of test_tp_families.py, against transformers
(float32, CPU): tensor names without the "model." prefix (a decoder saved from its base
model, as some conversions write them), mT5 (T5 v1.1's layers under mT5's config class) and
a Gemma 3 config with an attention score cap (which transformers leaves unused), and a
Llama of odd shapes saved in bfloat16 across several files.
Loading checks compare each rank's parameters with the ones the prefixed file gives, which
needs no Ray; one greedy run per case checks that transformers reads the file the same way."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_utils import assert_close_rel, greedy, load_rank, make_engine, prefill_logits
from tiny_models import (
    PROMPTS,
    family_checkpoint,
    hf_first_step_logits,
    hf_greedy,
    hf_last_logits,
)


def _strip_model_prefix(src, dst, prefix: str = "model."):
    """A copy of checkpoint src whose tensors are named without the leading prefix."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    assert any(n.startswith(prefix) for n in tensors)
    save_file({n.removeprefix(prefix): t for n, t in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mixtral", "phi3", "qwen2-moe"])
def test_names_without_the_model_prefix_load_the_same_weights(models_dir, tmp_path, name):
    """"embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "norm.weight" (the head,
    when untied, stays "lm_head.weight"): each rank gets the same parameters as from the
    prefixed file, experts (Mixtral; Qwen2-MoE's with its shared expert) and fused tensors
    (Phi-3) included."""
    path = family_checkpoint(models_dir, name)
    bare = _strip_model_prefix(path, tmp_path / f"{name}-bare")
    want, _ = load_rank(path, 1, 2)
    got, _ = load_rank(bare, 1, 2)
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize(("name", "prefix"), [("gpt-neox", "gpt_neox."), ("phi", "model.")])
def test_a_body_saved_without_its_prefix_matches_transformers(models_dir, tmp_path, name,
                                                              prefix):
    """GPT-NeoX ("layers.0.attention.query_key_value.weight", "embed_in.weight"; the head
    stays "embed_out.weight") and Phi ("layers.0.self_attn.dense.weight",
    "final_layernorm.weight") saved from their base models: transformers reads them as the
    prefixed files; tpserve refused both as missing every weight but the head. Each rank at
    tp = 2 gets the prefixed file's parameters, and tp = 1 continues as transformers."""
    path = family_checkpoint(models_dir, name)
    bare = _strip_model_prefix(path, tmp_path / f"{name}-bare", prefix)
    want, _ = load_rank(path, 1, 2)
    got, _ = load_rank(bare, 1, 2)
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
    ref = hf_greedy(bare, PROMPTS, 8)
    assert ref == hf_greedy(path, PROMPTS, 8)  # transformers reads both files alike
    _matches(bare, 1, ref, hf_last_logits(bare, PROMPTS), 8)


def test_llama_without_the_model_prefix_matches_transformers(llama_dir, tmp_path):
    """transformers loads such a file into LlamaForCausalLM as it loads the prefixed one
    (the same continuations), and tpserve at tp = 2 continues it as transformers does."""
    bare = _strip_model_prefix(llama_dir, tmp_path / "llama-bare")
    ref = hf_greedy(bare, PROMPTS, 16)
    assert ref == hf_greedy(llama_dir, PROMPTS, 16)
    engine = make_engine(bare, 2, forked=True)
    try:
        assert greedy(engine, PROMPTS, 16) == ref
    finally:
        engine.shutdown()


def _t5_variant(kind: str):
    """t5_config's Flan-style model (gated-gelu, an lm_head of its own) under mT5's or
    UMT5's config class. mT5 is T5 v1.1 (transformers never scales its decoder output);
    UMT5 gives every self-attention layer a relative position bias of its own."""
    from tiny_models import t5_config
    from transformers import MT5Config, UMT5Config

    args = t5_config(True).to_dict()
    for key in ("model_type", "architectures", "transformers_version"):
        args.pop(key, None)
    cls, arch = {"mt5": (MT5Config, "MT5ForConditionalGeneration"),
                 "umt5": (UMT5Config, "UMT5ForConditionalGeneration")}[kind]
    cfg = cls(**args)
    cfg.architectures = [arch]
    return cfg


@pytest.fixture(scope="module")
def t5_variant(models_dir):
    from tiny_models import save_t5_model

    cache = {}

    def get(kind: str):
        if kind not in cache:
            path = save_t5_model(_t5_variant(kind), models_dir / kind)
            cache[kind] = path, hf_greedy(path, PROMPTS, 16), hf_first_step_logits(path, PROMPTS)
        return cache[kind]

    return get


def test_umt5_layers_have_biases_of_their_own(t5_variant):
    """Guards the oracle: every UMT5 layer's bias is in the file and differs from the first
    layer's, so a model that shared the first layer's (as T5 does) would diverge."""
    from safetensors.torch import load_file

    path, _, _ = t5_variant("umt5")
    w = load_file(str(path / "model.safetensors"))
    for stack in ("encoder", "decoder"):
        first, second = (w[f"{stack}.block.{i}.layer.0.SelfAttention.relative_attention_bias"
                           ".weight"] for i in (0, 1))
        assert (first - second).abs().max() > 0.1


@pytest.mark.parametrize(("kind", "tp"), [("mt5", 1), ("mt5", 2), ("umt5", 1), ("umt5", 2)])
def test_mt5_and_umt5_match_transformers(t5_variant, kind, tp):
    """The first decoder step's logits (which a decoder output scaled by d_model ** -0.5,
    as T5 but not mT5 scales it, would change without changing greedy tokens) and greedy
    continuations."""
    path, ref, ref_logits = t5_variant(kind)
    # Guards the oracle (UMT5 repeats one token after the one-token prompt "A").
    assert sum(len(set(t)) > 3 for t in ref) >= 3 and len({tuple(t) for t in ref}) == 4
    _matches(path, tp, ref, ref_logits, 16, max_model_len=128)


@pytest.fixture(scope="module")
def gemma3_capped(models_dir):
    """gemma3_config with both caps set low enough to bite where applied: transformers'
    Gemma 3 caps the final logits but never the attention scores."""
    from tiny_models import gemma3_config, save_model

    cfg = gemma3_config(attn_logit_softcapping=4.0, final_logit_softcapping=15.0)
    path = save_model(cfg, models_dir / "gemma3-capped", std=0.3, vector_std=0.1)
    return path, hf_greedy(path, PROMPTS, 16), hf_last_logits(path, PROMPTS)


def test_gemma3_oracle_ignores_the_score_cap_and_applies_the_logit_cap(gemma3_capped):
    """Guards the oracle: dropping attn_logit_softcapping leaves transformers' logits as they
    are, dropping final_logit_softcapping changes them (so both are checked below)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, ref, ref_logits = gemma3_capped
    assert sum(len(set(t)) > 3 for t in ref) >= 3
    tok = AutoTokenizer.from_pretrained(path)
    for override, changes in (({"attn_logit_softcapping": None}, False),
                              ({"final_logit_softcapping": None}, True)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     **override).eval()
        with torch.no_grad():
            got = [model(tok(p, return_tensors="pt").input_ids).logits[0, -1] for p in PROMPTS]
        diff = max(float((g - r).abs().max()) for g, r in zip(got, ref_logits, strict=True))
        assert (diff > 0.05) is changes, (override, diff)


def test_gemma3_with_an_attention_cap_in_its_config_matches_transformers(gemma3_capped):
    """tpserve capped Gemma 3's attention scores as Gemma 2's (prefill logits 5e-2 off)."""
    path, ref, ref_logits = gemma3_capped
    _matches(path, 1, ref, ref_logits, 16)


@pytest.fixture(scope="module")
def odd_llama(models_dir):
    """One Llama with what the fixtures lack, together: hidden 96 with head_dim 32 (4 x 32 =
    128 != 96), one KV head (replicated at tp = 2 and 4), biases on attention and MLP,
    intermediate 200, a tied vocabulary of 1001 (padded at tp = 2 and 4), saved in bfloat16
    (config.json says so) across several files with a model.safetensors.index.json."""
    from tiny_models import llama_config, save_model

    cfg = llama_config(hidden_size=96, intermediate_size=200, num_attention_heads=4,
                       num_key_value_heads=1, head_dim=32, attention_bias=True, mlp_bias=True,
                       vocab_size=1001, tie_word_embeddings=True)
    path = save_model(cfg, models_dir / "llama-odd", std=0.3, vector_std=0.1,
                      save_dtype=torch.bfloat16, max_shard_size="100KB")
    assert len(list(path.glob("*.safetensors"))) > 1
    return path, hf_greedy(path, PROMPTS, 16), hf_last_logits(path, PROMPTS)


# tp = 2 already cuts the odd vocabulary and widths unevenly; tp = 4 runs in the slow job.
@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_llama_of_odd_shapes_in_bfloat16_shards_matches_transformers(odd_llama, tp):
    """Served in float32, as `--dtype auto` serves it on the CPU, against transformers'
    float32 model of the same bfloat16 weights."""
    from tpserve.cluster.device import resolve_dtype

    path, ref, ref_logits = odd_llama
    assert sum(len(set(t)) > 3 for t in ref) >= 3
    assert resolve_dtype("auto", "cpu", "bfloat16")[0] == "float32"
    _matches(path, tp, ref, ref_logits, 16)


# Phi-3 long-context scaling (Phi-3-*-128k, Phi-3.5, Phi-4-mini): rotary frequencies divided
# by short_factor within original_max_position_embeddings, cos/sin scaled by
# sqrt(1 + ln(factor) / ln(original)). The tiny model's original context (96) holds the
# longest prompt (52 tokens) and 32 new tokens; test_longrope.py goes past it (long_factor,
# the recompute at the crossing).
LONGROPE_ORIGINAL = 96


def _longrope(short=(1.0, 2.0, 4.0, 8.0)):
    """head_dim 16 at partial_rotary_factor 0.5: 4 frequencies, one factor each."""
    from tiny_models import phi3_config

    return phi3_config(
        rope_scaling={"type": "longrope", "short_factor": list(short),
                      "long_factor": [3.0, 6.0, 12.0, 24.0]},
        original_max_position_embeddings=LONGROPE_ORIGINAL,
        max_position_embeddings=4 * LONGROPE_ORIGINAL)


@pytest.fixture(scope="module")
def longrope(models_dir):
    from tiny_models import save_model

    path = save_model(_longrope(), models_dir / "phi3-longrope")
    return path, hf_greedy(path, PROMPTS, 32), hf_last_logits(path, PROMPTS)


def test_longrope_short_factors_change_the_reference(longrope, models_dir):
    """Guards the oracle: the same weights with short factors of 1 continue otherwise, so
    matching transformers checks them."""
    from tiny_models import save_model

    path, ref, _ = longrope
    assert all(len(set(t)) > 3 for t in ref) and len({tuple(t) for t in ref}) == 4
    plain = save_model(_longrope(short=(1.0, 1.0, 1.0, 1.0)), models_dir / "phi3-longrope-1")
    assert hf_greedy(plain, PROMPTS, 32) != ref


@pytest.mark.parametrize("tp", [1, 2])
def test_phi3_longrope_matches_transformers(longrope, tp):
    """Prefill logits (which the attention factor, 1.14 here, scales) and greedy tokens."""
    path, ref, ref_logits = longrope
    _matches(path, tp, ref, ref_logits, 32)


def _matches(path, tp: int, ref, ref_logits, new_tokens: int, **engine) -> None:
    """tpserve at tp: prefill logits within 1e-4 relative of transformers' and the same
    greedy tokens."""
    engine = make_engine(path, tp, local=tp == 1, forked=tp > 1, **engine)
    try:
        for got, want in zip(prefill_logits(engine, PROMPTS), ref_logits, strict=True):
            assert_close_rel(got, want, 1e-4)
        assert greedy(engine, PROMPTS, new_tokens) == ref
    finally:
        engine.shutdown()


def test_a_consolidated_file_beside_model_safetensors_is_not_read(llama_dir, tmp_path):
    """Mistral's repositories ship consolidated.safetensors (their own tensor names:
    layers.0.attention.wq.weight ..., norm.weight) beside the transformers checkpoint;
    transformers loads model.safetensors alone. tpserve opened both: it read the native
    'norm.weight' into the final norm (a name without the "model." prefix) until the file
    sorted after it overwrote it, and warned about every other native tensor."""
    from safetensors.torch import load_file, save_file

    from tpserve.weights import tensor_names

    path = tmp_path / "with-consolidated"
    shutil.copytree(llama_dir, path)
    hf = load_file(str(path / "model.safetensors"))
    # Another final norm under the native name, so reading it would change the model.
    save_file({"norm.weight": hf["model.norm.weight"] * 3,
               "layers.0.attention.wq.weight": hf["model.layers.0.self_attn.q_proj.weight"]},
              str(path / "consolidated.safetensors"))
    assert sorted(tensor_names(path)) == sorted(hf)
    model, stats = load_rank(path, 0, 1)
    assert sorted(stats.full_bytes) == sorted(hf)
    torch.testing.assert_close(model.model.norm.weight.data, hf["model.norm.weight"])


@pytest.fixture(scope="module")
def bloom_post_ln(models_dir):
    """Bloom whose residual stream carries the normed input
    (apply_residual_connection_post_layernorm: true, as bigscience's early checkpoints can
    set it), 4 heads (one per rank at tp = 4); the same weights without the flag continue
    otherwise (checked below), so matching transformers checks the flag."""
    from tiny_models import bloom_config, save_model

    path = save_model(bloom_config(apply_residual_connection_post_layernorm=True),
                      models_dir / "bloom-post-ln", std=0.5, vector_std=0.1)
    return path, hf_greedy(path, PROMPTS, 16), hf_last_logits(path, PROMPTS)


def test_bloom_post_layernorm_residual_changes_the_reference(bloom_post_ln, tmp_path):
    import json

    path, ref, _ = bloom_post_ln
    assert sum(len(set(t)) > 3 for t in ref) >= 3
    plain = shutil.copytree(path, tmp_path / "plain")
    cfg = json.loads((plain / "config.json").read_text())
    cfg["apply_residual_connection_post_layernorm"] = False
    (plain / "config.json").write_text(json.dumps(cfg))
    assert hf_greedy(plain, PROMPTS, 16) != ref


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_bloom_post_layernorm_residual_matches_transformers(bloom_post_ln, tp):
    path, ref, ref_logits = bloom_post_ln
    _matches(path, tp, ref, ref_logits, 16)


@pytest.mark.parametrize("names", [{"hidden_act": "gelu"},
                                   {"hidden_act": "gelu", "hidden_activation": "gelu"},
                                   {"hidden_act": "gelu_pytorch_tanh",
                                    "hidden_activation": "gelu"}])
def test_gemma_activation_as_released_configs_name_it(models_dir, tmp_path, names):
    """google/gemma-* config.json files say "hidden_act": "gelu" (the first releases, which
    mean the tanh approximation), some with a "hidden_activation" beside it; transformers'
    GemmaMLP applies hidden_act, "gelu" read as tanh. Served at tp = 1 as transformers."""
    import json

    path = shutil.copytree(family_checkpoint(models_dir, "gemma"), tmp_path / "gemma")
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("hidden_activation", None)
    (path / "config.json").write_text(json.dumps({**cfg, **names}))
    _matches(path, 1, hf_greedy(path, PROMPTS, 12), hf_last_logits(path, PROMPTS), 12)
