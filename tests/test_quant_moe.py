"""Quantized mixture-of-experts checkpoints (Mixtral, Qwen2-MoE with its shared expert,
Qwen3-MoE), experts stored one by one, served at tp = 1 (in process) and by tp = 2, 4 Ray shard actors: prefill logits
within 1e-4 relative and greedy continuations identical to transformers (float32, CPU) running
the same model with the dequantized weights. The checkpoints are quantized in the test
(tests/quant_checkpoints.py) from tiny random models (MOE_SHAPES: experts of 128, so group
size 32 keeps whole groups on each rank at tp = 4); routers stay float. The engine runs and
the oracle reuse tests/test_quant_tp.py's machinery."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from engine_utils import (
    assert_close_rel,
    engine_matches_reference,
    load_rank,
    make_engine,
    prefill_logits,
)
from quant_checkpoints import (
    MOE_SHAPES,
    float_checkpoint,
    quantized_with_reference,
    write_expert_scales_from,
)
from safetensors.torch import load_file, save_file
from tiny_models import PROMPTS, hf_last_logits

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.errors import CheckpointError, ShardingError
from tpserve.layers.moe import QuantizedExpert
from tpserve.layers.quant.config import QuantizationError
from tpserve.layers.quant.methods import Fp8Method, Int4Method, UnquantizedMethod
from tpserve.worker.build import check_shardable

# The routers as compressed-tensors' ignore lists name them (RedHatAI's MoE releases).
CT_ROUTERS = ("lm_head", r"re:.*mlp\.gate$", r"re:.*mlp\.shared_expert_gate$")
MOE = {
    # act-order on one case; Qwen2-MoE's shared expert quantized like a dense MLP
    "qwen2-moe-gptq-actorder": ("qwen2-moe", dict(fmt="gptq", group=32, sym=False,
                                                  act_order=True)),
    "qwen3-moe-gptq-sym": ("qwen3-moe", dict(fmt="gptq", group=32, sym=True)),
    # AutoAWQ's Mixtral: the router named in modules_to_not_convert
    "mixtral-awq": ("mixtral", dict(fmt="awq", group=32, not_convert=("gate",))),
    # Qwen3-30B-A3B-FP8's layout with blocks of 64: tp = 4 cuts them (32 rows a rank)
    "qwen3-moe-fp8-block": ("qwen3-moe", dict(fmt="fp8", fp8_block=(64, 64))),
    "mixtral-fp8": ("mixtral", dict(fmt="fp8")),
    "mixtral-gptq": ("mixtral", dict(fmt="gptq", group=32, sym=True)),
    "qwen2-moe-ct-w4a16-asym": ("qwen2-moe", dict(fmt="ct-w4a16", group=32, sym=False,
                                                  ignore=CT_ROUTERS)),
    "qwen3-moe-ct-fp8-dynamic": ("qwen3-moe", dict(fmt="ct-fp8-dynamic", ignore=CT_ROUTERS)),
}
# Default job: every format at tp = 2, AWQ at tp = 1; tp = 4 (act-order's rows and fp8
# blocks cut inside the experts) and the rest in the slow job (each case starts tp Ray
# actors; test_quant_tp's act-order tp = 4 case cuts groups the same way).
FAST = {("qwen2-moe-gptq-actorder", 2), ("qwen3-moe-gptq-sym", 2), ("mixtral-awq", 2),
        ("qwen3-moe-fp8-block", 2), ("qwen2-moe-ct-w4a16-asym", 2), ("mixtral-awq", 1)}
CASES = [pytest.param(name, tp, id=f"{name}-tp{tp}",
                      marks=() if (name, tp) in FAST else pytest.mark.slow)
         for name in MOE for tp in (1, 2, 4)]


@pytest.fixture(scope="module")
def quantized(models_dir):
    """name -> (quantized dir, reference tokens, reference logits), built once."""
    return lambda name: quantized_with_reference(models_dir, name, *MOE[name])


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_quantized_moe_matches_transformers(quantized, name, tp):
    path, ref_tokens, ref_logits = quantized(name)
    engine_matches_reference(path, tp, ref_tokens, ref_logits)


@pytest.mark.parametrize("name", sorted(MOE))
def test_the_oracle_sees_the_quantization(models_dir, quantized, name):
    """Oracle guard: the dequantized model's logits are not the float model's (so the
    comparison above checks the quantized weights), and its continuations are not
    degenerate."""
    _, ref_tokens, ref_logits = quantized(name)
    float_logits = hf_last_logits(float_checkpoint(models_dir, MOE[name][0]), PROMPTS)
    worst = max((a - b).abs().max().item() / b.abs().max().item()
                for a, b in zip(ref_logits, float_logits, strict=True))
    assert worst > 1e-2
    assert all(len(set(t)) > 3 for t in ref_tokens)
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)


@pytest.mark.parametrize("name", [
    "qwen3-moe-gptq-sym",
    pytest.param("qwen3-moe-fp8-block", marks=pytest.mark.slow),
])
def test_a_loader_that_mixed_up_experts_would_fail(models_dir, quantized, name):
    """Oracle guard: served with expert 0's scales (and zeros) on every expert, as a loader
    that mixed up experts would read them, the logits leave the tolerance by far."""
    path, _, ref_logits = quantized(name)
    mixed = write_expert_scales_from(path, models_dir / f"{name}-expert0-scales")
    engine = make_engine(mixed, 1, local=True)
    try:
        got = prefill_logits(engine, PROMPTS)
    finally:
        engine.shutdown()
    with pytest.raises(AssertionError):
        for a, b in zip(got, ref_logits, strict=True):
            assert_close_rel(a, b, 100 * 1e-4)


@pytest.mark.parametrize(("name", "method"), [
    ("qwen2-moe-gptq-actorder", Int4Method), ("qwen3-moe-fp8-block", Fp8Method)])
def test_experts_stay_quantized_and_each_rank_reads_its_slice(quantized, name, method):
    """Each expert's gate_up and down hold the checkpoint's quantized tensors (no float
    stack), the router and shared_expert_gate stay float and whole; at tp = 2 a rank reads
    half of each expert tensor split by rows or columns."""
    path = quantized(name)[0]
    model, stats = load_rank(path, 1, 2)
    moe = model.model.layers[0 if name.startswith("qwen3") else 1].mlp
    assert moe.w13 is None and len(moe.experts) == moe.num_experts
    for expert in moe.experts:
        assert isinstance(expert, QuantizedExpert)
        assert isinstance(expert.gate_up_proj.method, method)
        assert isinstance(expert.down_proj.method, method)
    assert moe.gate.weight.dtype == torch.float32
    prefix = moe.prefix
    tensor = "qweight" if method is Int4Method else "weight"
    for e in (0, moe.num_experts - 1):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert stats.fraction(f"{prefix}.experts.{e}.{proj}.{tensor}") == \
                pytest.approx(0.5)
    assert stats.fraction(f"{prefix}.gate.weight") == 1
    if name.startswith("qwen2"):
        assert isinstance(moe.shared_expert.down_proj.method, method)
        assert stats.fraction(f"{prefix}.shared_expert_gate.weight") == 1


def _cfg(tp: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="m", max_model_len=64),
                        parallel=ParallelConfig(tp_size=tp))


def _hf(family: str, quantization_config: dict, **overrides):
    from tiny_models import FAMILY_CHECKPOINTS

    hf = FAMILY_CHECKPOINTS[family][0](**{**MOE_SHAPES[family], **overrides})
    hf.quantization_config = quantization_config
    return hf


GPTQ64 = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False,
          "sym": True}


@pytest.mark.parametrize(("family", "tensor"), [
    ("qwen3-moe", "model.layers.0.mlp.experts.0.down_proj.qweight"),
    ("mixtral", "model.layers.0.block_sparse_moe.experts.0.w2.qweight"),
])
def test_a_tp_that_cuts_an_expert_group_is_refused_at_start(family, tensor):
    """Experts of 128 inputs to down, groups of 64: tp = 4 leaves a rank 32 (half a group);
    tp = 2 is served (built here on the meta device, as the launcher checks)."""
    check_shardable(_cfg(2), _hf(family, GPTQ64))
    with pytest.raises(ShardingError) as err:
        check_shardable(_cfg(4), _hf(family, GPTQ64))
    for needle in (repr(tensor), "tp=4", "group size 64", "128 input features"):
        assert needle in str(err.value)


def test_act_order_experts_shard_where_groups_would_be_cut():
    """With act-order a row-parallel rank keeps every group's scales: tp = 4 is served."""
    check_shardable(_cfg(4), _hf("qwen3-moe", {**GPTQ64, "desc_act": True}))


@pytest.mark.parametrize(("family", "ignore", "router"), [
    ("qwen3-moe", ["lm_head"], "model.layers.0.mlp.gate"),
    ("qwen2-moe", ["lm_head", r"re:.*mlp\.gate$"], "model.layers.1.mlp.shared_expert_gate"),
])
def test_a_compressed_tensors_router_not_ignored_is_refused_at_start(family, ignore, router):
    from quant_checkpoints import ct_quantization_config

    hf = _hf(family, ct_quantization_config("ct-w4a16", 32, True, tuple(ignore)))
    with pytest.raises(QuantizationError) as err:
        check_shardable(_cfg(2), hf)
    assert repr(router) in str(err.value) and "ignore" in str(err.value)


def test_a_router_stored_quantized_is_refused_at_load(models_dir, quantized):
    """A GPTQ file whose router holds qweight/scales instead of a float weight."""
    src = quantized("qwen3-moe-gptq-sym")[0]
    out = models_dir / "qwen3-moe-gptq-quantized-router"
    shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    router = "model.layers.2.mlp.gate"
    del weights[f"{router}.weight"]
    weights[f"{router}.qweight"] = torch.zeros(16, 8, dtype=torch.int32)
    weights[f"{router}.scales"] = torch.ones(4, 8, dtype=torch.float16)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"'{router}.")) as err:
        load_rank(out, 0, 1)
    assert "router" in str(err.value) and "quantized" in str(err.value)


def test_granite_moe_still_refuses_quantized_checkpoints():
    """GraniteMoE stores its experts fused (input_linear / output_linear) only."""
    from tiny_models import granite_moe_config

    hf = granite_moe_config()
    hf.quantization_config = GPTQ64
    with pytest.raises(ValueError, match="quantized GraniteMoE checkpoints are not supported"
                                         ".*stores its experts fused"):
        check_shardable(_cfg(2), hf)


def test_experts_a_checkpoint_keeps_float_load_float(quantized):
    """AWQ's modules_to_not_convert ("gate") keeps Mixtral's routers float, its experts
    (w1/w2/w3) quantized; a config that names the experts keeps them float per expert."""
    path = quantized("mixtral-awq")[0]
    assert json.loads((path / "config.json").read_text())["quantization_config"][
        "modules_to_not_convert"] == ["gate"]
    model, _ = load_rank(path, 0, 1)
    moe = model.model.layers[0].mlp
    assert isinstance(moe.experts[0].gate_up_proj.method, Int4Method)
    assert isinstance(moe.experts[0].down_proj.method, Int4Method)
    assert not isinstance(model.model.layers[0].self_attn.qkv_proj.method, UnquantizedMethod)


def test_the_graph_safe_path_gives_the_routed_sums_with_quantized_experts(monkeypatch,
                                                                         quantized):
    """Inside a CUDA graph capture every expert runs on every token with zero weights for
    the others (layers/moe.py); with quantized experts (and the shared one) the sums are the
    eager routed path's."""
    import tpserve.layers.moe as moe_mod
    from tpserve.distributed import tp_context

    model, _ = load_rank(quantized("qwen2-moe-gptq-actorder")[0], 0, 1)
    moe = model.model.layers[1].mlp
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(0))
    with tp_context(0, 1):
        routed = moe(x)
        monkeypatch.setattr(moe_mod, "stream_capturing", lambda device: True)
        dense = moe(x)
    torch.testing.assert_close(dense, routed, atol=1e-5, rtol=1e-5)
    assert bool(((moe.route(x) > 0).sum(-1) == 2).all())


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}
GPTQ128 = {**GPTQ64, "group_size": 128}


def _real(name: str, quantization_config: dict):
    from test_model_shapes import hf_config

    hf = hf_config(name)
    hf.quantization_config = quantization_config
    return hf


@pytest.mark.parametrize(("name", "quant", "tp"), [
    # Qwen3-30B-A3B-FP8: experts of 768 at tp = 4 are 1.5 blocks of 128 a rank
    ("Qwen3-30B-A3B", FP8_BLOCKS, 4),
    ("Qwen3-30B-A3B", GPTQ128, 2),
    ("Mixtral-8x7B-v0.1", {**GPTQ128, "desc_act": True}, 8),
])
def test_the_real_moe_configs_build_quantized(name, quant, tp):
    check_shardable(_cfg(tp), _real(name, quant))


@pytest.mark.parametrize(("name", "tp", "needles"), [
    # experts of 768 (6 groups of 128): tp = 4 would give a rank 1.5 groups of down_proj
    ("Qwen3-30B-A3B", 4, ("'model.layers.0.mlp.experts.0.down_proj.qweight'", "tp=4",
                          "group size 128", "divides 6 groups")),
    # experts of 1408: 11 groups, so only tp = 1 without act-order
    ("Qwen1.5-MoE-A2.7B-Chat", 2, ("'model.layers.0.mlp.experts.0.down_proj.qweight'",
                                   "tp=2", "group size 128", "divides 11 groups")),
])
def test_the_real_gptq_moe_configs_refuse_a_tp_that_cuts_groups(name, tp, needles):
    with pytest.raises(ShardingError) as err:
        check_shardable(_cfg(tp), _real(name, GPTQ128))
    for needle in needles:
        assert needle in str(err.value)


@pytest.mark.parametrize(("edit", "needle"), [
    ("missing", "model.layers.0.mlp.experts.3.down_proj.qweight"),
    ("fused", "'model.layers.0.mlp.experts.gate_up_proj': experts stored fused"),
])
def test_a_quantized_checkpoint_missing_an_expert_or_with_fused_experts_is_refused(
        models_dir, quantized, edit, needle):
    src = quantized("qwen3-moe-gptq-sym")[0]
    out = models_dir / f"qwen3-moe-gptq-{edit}-experts"
    shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    if edit == "missing":
        del weights["model.layers.0.mlp.experts.3.down_proj.qweight"]
    else:
        weights["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(8, 256, 128)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        load_rank(out, 0, 1)
