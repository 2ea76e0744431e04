"""Quantized DeepSeek-V2 / V3 checkpoints (GPTQ with and without act-order, AWQ,
compressed-tensors int4) and --quantize fp8 served by Ray shard actors against transformers
(float32, CPU) running the same model with the dequantized weights: prefill logits within
1e-4 relative, 32 greedy tokens identical. The checkpoints are quantized in the test
(tests/quant_checkpoints.py): every MLA projection (q_proj or q_a_proj / q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj), the dense MLP, the shared experts and each routed
expert one by one; routers (mlp.gate, V3's e_score_correction_bias) stay float. DS_SHAPE
keeps groups of 32 whole at tp = 2 (experts of 64, o_proj of 4 heads x 16)."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_utils import assert_matches_reference, engine_matches_reference, load_rank, make_engine
from quant_checkpoints import write_fp8_cast_reference, write_quantized
from safetensors.torch import load_file, save_file
from tiny_models import (
    FAMILY_CHECKPOINTS,
    PROMPTS,
    hf_greedy,
    hf_last_logits,
    save_model,
)

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.errors import ShardingError
from tpserve.layers.moe import QuantizedExpert
from tpserve.layers.quant.methods import CtInt4Method, Fp8Method, Int4Method
from tpserve.worker.build import check_shardable

# q_lora_rank 64 (V3): q_b_proj's inputs are two whole groups of 32.
DS_SHAPE = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=64)
V3_SHAPE = dict(DS_SHAPE, q_lora_rank=64)
CT_ROUTERS = ("lm_head", r"re:.*mlp\.gate$")
CHECKPOINTS = {
    "v2-gptq-sym": ("deepseek-v2", dict(fmt="gptq", group=32, sym=True)),
    "v2-gptq-actorder": ("deepseek-v2", dict(fmt="gptq", group=32, sym=False, act_order=True)),
    "v3-gptq-sym": ("deepseek-v3", dict(fmt="gptq", group=32, sym=True)),
    "v3-gptq-actorder": ("deepseek-v3", dict(fmt="gptq", group=32, sym=False, act_order=True)),
    "v2-awq": ("deepseek-v2", dict(fmt="awq", group=32)),
    "v3-awq": ("deepseek-v3", dict(fmt="awq", group=32)),
    "v2-ct-w4a16": ("deepseek-v2", dict(fmt="ct-w4a16", group=32, sym=True,
                                        ignore=CT_ROUTERS)),
    "v3-ct-w4a16-asym": ("deepseek-v3", dict(fmt="ct-w4a16", group=32, sym=False,
                                             ignore=CT_ROUTERS)),
}
# Default job: each format on each version at tp = 2 where it differs most, AWQ at tp = 1;
# act-order rows at tp = 4 (groups of 32 cut there) and the rest slow (each case starts tp
# Ray actors; test_quant_tp's act-order tp = 4 case cuts groups the same way).
# V3's AWQ at tp = 2 runs in the slow job (V2's AWQ at tp = 1 and V3's other formats at
# tp = 2 stay here).
FAST = {("v2-gptq-sym", 2), ("v3-gptq-actorder", 2), ("v2-awq", 1), ("v3-ct-w4a16-asym", 2)}
CASES = [pytest.param(name, tp, id=f"{name}-tp{tp}",
                      marks=() if (name, tp) in FAST else pytest.mark.slow)
         for name in CHECKPOINTS for tp in (1, 2)] + [
    pytest.param(name, 4, id=f"{name}-tp4", marks=() if (name, 4) in FAST else pytest.mark.slow)
    for name in ("v2-gptq-actorder", "v3-gptq-actorder")]

_REFS: dict[str, tuple] = {}


def float_deepseek(models_dir, family: str):
    out = models_dir / f"quant-float-{family}"
    if not (out / "config.json").exists():
        config, kwargs = FAMILY_CHECKPOINTS[family]
        save_model(config(**(V3_SHAPE if family == "deepseek-v3" else DS_SHAPE)), out,
                   **kwargs)
    return out


def quantized_deepseek(models_dir, name: str) -> tuple:
    """(quantized dir, transformers' greedy tokens and last logits on the dequantized twin)."""
    if name not in _REFS:
        family, kwargs = CHECKPOINTS[name]
        qdir, ref = write_quantized(float_deepseek(models_dir, family), models_dir / name,
                                    models_dir / f"{name}-ref", **kwargs)
        _REFS[name] = (qdir, hf_greedy(ref, PROMPTS, 32), hf_last_logits(ref, PROMPTS))
    return _REFS[name]


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_quantized_deepseek_matches_transformers(models_dir, name, tp):
    path, ref_tokens, ref_logits = quantized_deepseek(models_dir, name)
    engine_matches_reference(path, tp, ref_tokens, ref_logits)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_the_oracle_sees_the_quantization(models_dir, name):
    """Oracle guard: the dequantized model's logits are not the float model's, and its
    continuations are not degenerate."""
    _, ref_tokens, ref_logits = quantized_deepseek(models_dir, name)
    float_logits = hf_last_logits(float_deepseek(models_dir, CHECKPOINTS[name][0]), PROMPTS)
    worst = max((a - b).abs().max().item() / b.abs().max().item()
                for a, b in zip(ref_logits, float_logits, strict=True))
    assert worst > 1e-2
    assert all(len(set(t)) > 3 for t in ref_tokens)
    assert len({tuple(t) for t in ref_tokens}) == len(ref_tokens)


def write_deepseek_cast_reference(src, out, tp: int):
    """write_fp8_cast_reference's oracle with the routed experts left float: --quantize fp8
    keeps a float checkpoint's experts stacked and float (layers/moe.py); the MLA
    projections, dense MLP and shared experts are cast per channel of each rank's slice."""
    ref = write_fp8_cast_reference(src, out, tp)
    weights, original = load_file(ref / "model.safetensors"), load_file(src / "model.safetensors")
    for name in weights:
        if ".mlp.experts." in name:
            weights[name] = original[name]
    save_file(weights, ref / "model.safetensors", metadata={"format": "pt"})
    return ref


@pytest.mark.parametrize(("family", "tp"), [
    ("deepseek-v2", 2), ("deepseek-v3", 2),
    pytest.param("deepseek-v3", 1, marks=pytest.mark.slow)])
def test_fp8_cast_at_load_matches_transformers(models_dir, family, tp):
    src = float_deepseek(models_dir, family)
    ref = write_deepseek_cast_reference(src, models_dir / f"{family}-fp8-cast-ref-tp{tp}", tp)
    ref_logits = hf_last_logits(ref, PROMPTS)
    float_logits = hf_last_logits(src, PROMPTS)  # oracle guard: the cast is visible
    assert max((a - b).abs().max().item() / b.abs().max().item()
               for a, b in zip(ref_logits, float_logits, strict=True)) > 1e-3
    engine = make_engine(src, tp, quantize="fp8", local=tp == 1, forked=tp > 1)
    try:
        assert_matches_reference(engine, PROMPTS, hf_greedy(ref, PROMPTS, 32), ref_logits)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("name", "method", "tensor"), [
    ("v3-gptq-actorder", Int4Method, "qweight"),
    ("v2-ct-w4a16", CtInt4Method, "weight_packed")])
def test_layers_stay_quantized_and_each_rank_reads_its_slice(models_dir, name, method, tensor):
    """MLA's projections, the dense MLP, shared and routed experts hold the checkpoint's
    int4 tensors; the router stays float32 and whole; at tp = 2 a rank reads half of each
    split tensor and the whole of the replicated latent projections."""
    path = quantized_deepseek(models_dir, name)[0]
    model, stats = load_rank(path, 1, 2)
    attn, moe = model.model.layers[1].self_attn, model.model.layers[1].mlp
    q = attn.q_b_proj if attn.q_proj is None else attn.q_proj
    for layer in (q, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj,
                  model.model.layers[0].mlp.gate_up_proj, moe.shared_experts.down_proj):
        assert isinstance(layer.method, method)
    assert moe.w13 is None and all(isinstance(e, QuantizedExpert) for e in moe.experts)
    assert isinstance(moe.experts[0].down_proj.method, method)
    assert moe.gate.weight.dtype == torch.float32
    pre = "model.layers.1"
    q_name = "q_b_proj" if attn.q_proj is None else "q_proj"
    for half in (f"self_attn.{q_name}", "self_attn.kv_b_proj", "self_attn.o_proj",
                 "mlp.shared_experts.down_proj", "mlp.experts.7.gate_proj", "mlp.experts.0.down_proj"):
        assert stats.fraction(f"{pre}.{half}.{tensor}") == pytest.approx(0.5), half
    assert stats.fraction(f"{pre}.self_attn.kv_a_proj_with_mqa.{tensor}") == 1
    assert stats.fraction(f"{pre}.mlp.gate.weight") == 1


def _cfg(tp: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="m", max_model_len=64),
                        parallel=ParallelConfig(tp_size=tp))


GPTQ32 = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}


@pytest.mark.parametrize("family", ["deepseek-v2", "deepseek-v3"])
def test_a_tp_that_cuts_an_int4_group_is_refused_at_start(family):
    """o_proj's 64 inputs (4 heads x 16) are 2 groups of 32: tp = 2 is served, tp = 4 (16 a
    rank) refused naming the tensor; with act-order tp = 4 is served."""
    config = FAMILY_CHECKPOINTS[family][0]
    shape = V3_SHAPE if family == "deepseek-v3" else DS_SHAPE

    def hf(quant):
        c = config(**shape)
        c.quantization_config = quant
        return c

    check_shardable(_cfg(2), hf(GPTQ32))
    check_shardable(_cfg(4), hf({**GPTQ32, "desc_act": True}))
    with pytest.raises(ShardingError) as err:
        check_shardable(_cfg(4), hf(GPTQ32))
    for needle in ("'model.layers.0.self_attn.o_proj.qweight'", "tp=4", "group size 32",
                   "64 input features"):
        assert needle in str(err.value)


def test_fp8_block_checkpoints_still_load(models_dir):
    """The V3 / R1 fp8 layout (weight_scale_inv blocks) is unchanged by the int4 path."""
    src = float_deepseek(models_dir, "deepseek-v3")
    qdir, _ = write_quantized(src, models_dir / "v3-fp8-block-32", models_dir / "v3-fp8-b-ref",
                              fmt="fp8", fp8_block=(32, 32))
    model, _ = load_rank(qdir, 0, 2)
    assert isinstance(model.model.layers[1].mlp.experts[0].down_proj.method, Fp8Method)
    shutil.rmtree(models_dir / "v3-fp8-b-ref")
