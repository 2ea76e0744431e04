"""Quantized checkpoints shaped unlike tests/test_quant_tp.py's: a family tpserve does not
serve quantized (T5; Cohere's fp8 checkpoints) is refused at start with the family, the
method and what to do,
instead of failing at load on a tensor shape; --quantize fp8 (a cast at load) still serves
them, Bloom and GPTBigCode too, and matches transformers running the same per-channel cast."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_utils import greedy, make_engine
from tiny_models import (
    PROMPTS,
    bloom_config,
    cohere2_config,
    cohere_config,
    gpt_bigcode_config,
    hf_greedy,
    save_model,
    t5_config,
)

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.layers.quant.config import QuantizationError
from tpserve.worker.build import check_shardable

GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}


def engine_cfg(tp: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                        parallel=ParallelConfig(tp_size=tp))


CONFIGS = {"bloom": (bloom_config, "BloomForCausalLM"),
           "t5": (t5_config, "T5ForConditionalGeneration"),
           "gpt-bigcode": (gpt_bigcode_config, "GPTBigCodeForCausalLM"),
           "gpt-bigcode-mha": (lambda: gpt_bigcode_config(multi_query=False),
                               "GPTBigCodeForCausalLM"),
           "cohere": (cohere_config, "CohereForCausalLM"),
           "cohere2": (cohere2_config, "Cohere2ForCausalLM")}


@pytest.mark.parametrize(("family", "qcfg"), [("t5", GPTQ), ("t5", AWQ), ("t5", FP8),
                                              ("cohere", FP8), ("cohere2", FP8)])
def test_quantized_checkpoint_of_a_family_without_int4_layers_is_refused(family, qcfg):
    """T5's relative-attention layers load float weights only; Cohere's q/k rows are
    reordered at load (interleaved rotary), which tpserve does for float and int4 tensors
    (tests/test_quant_cohere.py), not for an fp8 checkpoint's. (Bloom, GPT-NeoX, Phi and
    GPTBigCode are served quantized: tests/test_quant_tp.py.)"""
    build, name = CONFIGS[family]
    hf = build()
    hf.quantization_config = dict(qcfg)
    with pytest.raises(QuantizationError) as err:
        check_shardable(engine_cfg(2), hf)
    msg = str(err.value)
    for needle in (name, qcfg["quant_method"], "--quantize fp8"):
        assert needle in msg, msg


# family -> (config builder, the linears' weight names that --quantize fp8 casts).
CAST = {"bloom": (bloom_config, ("query_key_value.weight", "dense.weight",
                                 "dense_h_to_4h.weight", "dense_4h_to_h.weight")),
        "gpt-bigcode": (gpt_bigcode_config, ("c_attn.weight", "c_proj.weight",
                                             "c_fc.weight")),
        "cohere": (lambda: cohere_config(use_qk_norm=True),
                   ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                    "gate_proj.weight", "up_proj.weight", "down_proj.weight"))}


@pytest.mark.parametrize("family", sorted(CAST))
def test_cast_to_fp8_at_load_matches_transformers(models_dir, tmp_path, family):
    """--quantize fp8 on a float Bloom, GPTBigCode (multi-query c_attn fused [q; k; v]) or
    Cohere (q/k rows reordered at load, then cast) at tp = 1: each linear's rows scaled to e4m3 at load; the oracle is transformers on the
    same cast weights."""
    from safetensors.torch import load_file, save_file

    build, linears = CAST[family]
    src = save_model(build(), models_dir / f"{family}-fp8-cast-src", std=0.5, vector_std=0.1)
    weights = load_file(src / "model.safetensors")
    for name, w in weights.items():
        if name.endswith(linears):
            scale = (w.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            weights[name] = (w / scale).to(torch.float8_e4m3fn).float() * scale
    ref = tmp_path / "ref"
    shutil.copytree(src, ref)
    save_file(weights, ref / "model.safetensors", metadata={"format": "pt"})
    engine = make_engine(src, 1, local=True, quantize="fp8")
    try:
        assert greedy(engine, PROMPTS, 12) == hf_greedy(ref, PROMPTS, 12)
    finally:
        engine.shutdown()


# AutoGPTQ before its settings joined config.json wrote them to quantize_config.json (with
# no quant_method in its older releases); early AutoAWQ wrote quant_config.json with its own
# key names. config.json then has no quantization_config.
SIDE_FILES = {
    "gptq": ("quantize_config.json", {"bits": 4, "group_size": 32, "damp_percent": 0.01,
                                      "desc_act": False, "sym": True, "true_sequential": True,
                                      "model_file_base_name": "model"}),
    "awq": ("quant_config.json", {"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                  "version": "GEMM"}),
}


@pytest.mark.parametrize("fmt", sorted(SIDE_FILES))
def test_quantization_settings_in_a_file_of_their_own_are_read(models_dir, tmp_path, fmt):
    import json

    from quant_checkpoints import write_quantized
    from tiny_models import llama_config

    src = models_dir / "side-file-float"
    if not (src / "config.json").exists():
        save_model(llama_config(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                                num_key_value_heads=2), src)
    qdir, ref = write_quantized(src, tmp_path / "q", tmp_path / "ref", fmt=fmt, group=32)
    config = json.loads((qdir / "config.json").read_text())
    del config["quantization_config"]
    (qdir / "config.json").write_text(json.dumps(config))
    name, settings = SIDE_FILES[fmt]
    (qdir / name).write_text(json.dumps(settings))
    engine = make_engine(qdir, 1, local=True)
    try:
        assert greedy(engine, PROMPTS, 12) == hf_greedy(ref, PROMPTS, 12)
    finally:
        engine.shutdown()


def test_quantized_vision_language_gemma3_is_served_quantized(models_dir, tmp_path):
    """A GPTQ Gemma 3 vision-language checkpoint keeps quantization_config on the outer
    config; served as text, its language model must still be built quantized."""
    from quant_checkpoints import write_quantized
    from tiny_models import family_checkpoint

    src = family_checkpoint(models_dir, "gemma3-vlm")
    qdir, ref = write_quantized(src, tmp_path / "q", tmp_path / "ref", fmt="gptq", group=32,
                                sym=False)
    engine = make_engine(qdir, 1, local=True)
    try:
        assert greedy(engine, PROMPTS, 12) == hf_greedy(ref, PROMPTS, 12)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("extra", [{"checkpoint_format": "marlin"}, {"is_marlin_format": True},
                                   {"checkpoint_format": "bitblas"}])
def test_gptq_layouts_other_than_gptq_and_gptq_v2_are_refused(extra):
    """Marlin- or BitBLAS-packed GPTQ checkpoints store other tensors (B, s, ...) in another
    order; read as the gptq layout they would fail at load on missing qweight tensors, or
    worse, load garbage. They are refused by name at start."""
    from types import SimpleNamespace

    from tpserve.layers.quant.config import resolve_quant

    hf = SimpleNamespace(quantization_config={**GPTQ, **extra})
    with pytest.raises(QuantizationError) as err:
        resolve_quant("auto", hf)
    fmt = extra.get("checkpoint_format", "marlin")
    assert f"'{fmt}'" in str(err.value) and "gptq_v2" in str(err.value), str(err.value)
