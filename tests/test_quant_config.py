"""--quantize resolution against a checkpoint's quantization_config, tp refusals that name the
tensor, the group size and tp, and what a rank holds (sizes, bytes) on the meta device."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama_config

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.distributed import tp_context
from tpserve.errors import ShardingError
from tpserve.layers.quant.config import QuantizationError, resolve_quant
from tpserve.worker.build import build_model, check_shardable

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2)


def config(quant: dict | None):
    cfg = llama_config(**SHAPE)
    if quant is not None:
        cfg.quantization_config = quant
    return cfg


def gptq(group=32, desc_act=False, **kw):
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
            "sym": True, **kw}


def engine_cfg(tp: int, quantize: str = "auto") -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="t", quantize=quantize),
                        parallel=ParallelConfig(tp_size=tp))


def test_auto_follows_the_checkpoint():
    q = resolve_quant("auto", config(gptq(64, desc_act=True)))
    assert (q.method, q.group_size, q.desc_act, q.zero_offset) == ("gptq", 64, True, 1)
    assert resolve_quant("auto", config(gptq(checkpoint_format="gptq_v2"))).zero_offset == 0
    awq = resolve_quant("auto", config({"quant_method": "awq", "bits": 4, "group_size": 128,
                                        "zero_point": True, "version": "GEMM"}))
    assert (awq.method, awq.sym, awq.zero_offset) == ("awq", False, 0)
    assert resolve_quant("auto", config(None)) is None
    assert resolve_quant("fp8", config(None)).cast_at_load


@pytest.mark.parametrize(("quant", "dynamic"), [
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, True),
    ({"quant_method": "fp8", "activation_scheme": "static"}, False),
    ({"quant_method": "fp8"}, False),
    (None, False),  # --quantize fp8 casting a float checkpoint: weight-only
])
def test_fp8_activations_follow_the_checkpoints_scheme(quant, dynamic):
    q = resolve_quant("fp8", config(quant))
    assert q.dynamic_activations is dynamic
    assert ("dynamic e4m3 activations" in q.describe()) is dynamic


@pytest.mark.parametrize(("requested", "quant", "needle"), [
    ("gptq", None, "no quantization_config"),
    ("none", gptq(), "--quantize none cannot serve it"),
    ("awq", gptq(), "says 'gptq'"),
    ("auto", {"quant_method": "awq", "bits": 4, "version": "gemv"}, "GEMM layout"),
    ("auto", gptq(bits=8), "8 bits"),
    ("auto", gptq(lm_head=True), "float head"),
    ("auto", {"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ("auto", {"quant_method": "fp8", "weight_block_size": [128, 0]}, "two positive integers"),
    ("auto", {"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'.*reads e4m3"),
    ("auto", {"quant_method": "bitsandbytes"}, "not supported"),
    ("bogus", None, "choose one of"),
])
def test_refusals_say_what_to_do(requested, quant, needle):
    with pytest.raises(QuantizationError, match=needle):
        resolve_quant(requested, config(quant))


FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}  # as Qwen/Qwen3-8B-FP8's config.json


def test_fp8_block_scales_are_read():
    q = resolve_quant("auto", config(FP8_BLOCKS))
    assert (q.method, q.block, q.dynamic_activations) == ("fp8", (128, 128), True)
    assert "128 x 128 block scales" in q.describe() and "weight-only" in q.describe()
    assert resolve_quant("fp8", config(FP8_BLOCKS)).block == (128, 128)
    assert resolve_quant("auto", config({"quant_method": "fp8"})).block is None


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_fp8_blocks_shard_at_every_tp_even_inside_a_block(tp):
    """Intermediate 320 with 128 x 128 blocks: at tp = 2 a rank's 160 gate/up rows and 160
    down_proj columns start inside a block, at tp = 4 its 80. Served exactly: a rank holds
    smaller blocks (the gcd of the block and the offsets it starts at), each with its
    checkpoint block's scale. K and V (64 rows) are each smaller than a block."""
    cfg = llama_config(hidden_size=128, intermediate_size=320, num_attention_heads=4,
                       num_key_value_heads=2)
    cfg.quantization_config = FP8_BLOCKS
    check_shardable(engine_cfg(tp), cfg)
    with tp_context(tp - 1, tp):
        model = build_model(engine_cfg(tp), cfg, torch.device("meta"))
    layer = model.model.layers[0]
    held = {name: (mod.method.block, tuple(mod.weight_scale_inv.shape))
            for name, mod in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                              ("gate_up", layer.mlp.gate_up_proj),
                              ("down", layer.mlp.down_proj))}
    assert held == {
        1: {"qkv": ((64, 128), (4, 1)), "o": ((128, 128), (1, 1)),
            "gate_up": ((64, 128), (10, 1)), "down": ((128, 128), (1, 3))},
        2: {"qkv": ((32, 128), (4, 1)), "o": ((128, 64), (1, 1)),
            "gate_up": ((32, 128), (10, 1)), "down": ((128, 32), (1, 5))},
        4: {"qkv": ((32, 128), (3, 1)), "o": ((128, 32), (1, 1)),
            "gate_up": ((16, 128), (10, 1)), "down": ((128, 16), (1, 5))},
    }[tp]


def test_a_tp_that_cuts_a_group_is_refused_at_start():
    """o_proj has 128 input features: group 64 gives 2 groups, so tp = 4 would cut one."""
    check_shardable(engine_cfg(2), config(gptq(64)))
    with pytest.raises(ShardingError) as err:
        check_shardable(engine_cfg(4), config(gptq(64)))
    msg = str(err.value)
    assert "model.layers.0.self_attn.o_proj.qweight" in msg
    assert "group size 64" in msg and "tp=4" in msg


def test_act_order_shards_rows_and_keeps_every_group_scale():
    """With act-order a row-parallel rank's rows belong to any group: it holds all scales."""
    check_shardable(engine_cfg(4), config(gptq(64, desc_act=True)))
    with tp_context(1, 4):
        model = build_model(engine_cfg(4), config(gptq(64, desc_act=True)), torch.device("meta"))
    o = model.model.layers[0].self_attn.o_proj
    assert tuple(o.qweight.shape) == (32 // 8, 128) and tuple(o.g_idx.shape) == (32,)
    assert tuple(o.scales.shape) == (2, 128)


def test_packing_refuses_output_slices_that_are_not_multiples_of_8():
    cfg = llama_config(hidden_size=64, intermediate_size=136, num_attention_heads=4,
                       num_key_value_heads=2)
    cfg.quantization_config = gptq(32)
    with pytest.raises(ShardingError, match="multiple of 8"):
        check_shardable(engine_cfg(2), cfg)  # gate/up: 68 output features per rank


@pytest.mark.parametrize(("quant", "quantize", "bytes_per_weight"), [
    (None, "auto", 4.0),  # float32 on the CPU
    (gptq(32), "auto", 0.5),
    (None, "fp8", 1.0),
    (FP8_BLOCKS, "auto", 1.0),
])
def test_weight_bytes_per_rank(quant, quantize, bytes_per_weight):
    """The quantized linears hold int32-packed nibbles or fp8 bytes; the embedding, norms and
    LM head stay float. Scales and zeros (one pair per group of 32) come on top."""
    with tp_context(0, 2):
        model = build_model(engine_cfg(2, quantize), config(quant), torch.device("meta"))
    layer = model.model.layers[0]
    mods = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
            layer.mlp.down_proj]
    weights = sum(m.in_features * m.out_features for m in mods) / 2
    main = sum(p.numel() * p.element_size() for m in mods
               for n, p in m.named_parameters() if n in ("weight", "qweight"))
    assert main == weights * bytes_per_weight


def test_launch_flags_reach_the_engine_config_and_refuse_early(tmp_path, llama_dir):
    """--quantize is resolved against the checkpoint before any shard starts."""
    from tpserve.cli import build_parser, engine_config

    args = build_parser().parse_args(["launch", "--model", str(llama_dir), "--device", "cpu",
                                      "--quantize", "fp8", "--quant-kernel", "torch"])
    cfg = engine_config(args)
    assert (cfg.model.quantize, cfg.model.quant_kernel) == ("fp8", "torch")
    args = build_parser().parse_args(["launch", "--model", str(llama_dir), "--device", "cpu",
                                      "--quantize", "gptq"])
    with pytest.raises(QuantizationError, match="no quantization_config"):
        engine_config(args)
