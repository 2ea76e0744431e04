"""compressed-tensors checkpoints (llm-compressor's format): the quantization_config mapped onto
the fp8 and int4 methods, refusals that name what the checkpoint has, the group-cut refusal
naming weight_packed, ignore lists (names and regexes) honoured, the oracle guarded, and the
test's writer checked against the compressed-tensors library where it is installed. Served
against transformers at tp = 1, 2, 4: tests/test_quant_tp.py (the ct-* checkpoints)."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_utils import load_rank
from quant_checkpoints import (
    SHAPE,
    ct_quantization_config,
    float_checkpoint,
    pack_along_cols,
    pack_along_rows,
    quantize_int4,
    write_quantized,
)
from tiny_models import PROMPTS, hf_last_logits, llama_config

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.errors import ShardingError
from tpserve.layers.quant import compressed_tensors
from tpserve.layers.quant.config import QuantizationError, resolve_quant
from tpserve.layers.quant.methods import Fp8Method, Int4Method, UnquantizedMethod
from tpserve.worker.build import check_shardable


def config(quant: dict | None):
    cfg = llama_config(**SHAPE)
    if quant is not None:
        cfg.quantization_config = quant
    return cfg


def engine_cfg(tp: int, quantize: str = "auto") -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="t", quantize=quantize),
                        parallel=ParallelConfig(tp_size=tp))


def ct(fmt: str = "ct-w4a16", group: int = 32, sym: bool = True, ignore=("lm_head",),
       weights: dict | None = None, acts: dict | None | str = "preset", **top) -> dict:
    """A quantization_config as llm-compressor writes it, with fields replaced."""
    q = ct_quantization_config(fmt, group, sym, ignore)
    scheme = q["config_groups"]["group_0"]
    scheme["weights"].update(weights or {})
    if acts != "preset":
        scheme["input_activations"] = acts
    q.update(top)
    return q


@pytest.mark.parametrize(("quant", "want"), [
    (ct("ct-w4a16", 128), dict(method="compressed-tensors", group_size=128, sym=True)),
    (ct("ct-w4a16", 32, sym=False), dict(method="compressed-tensors", group_size=32,
                                         sym=False, zero_offset=0)),
    (ct("ct-w4a16", -1), dict(method="compressed-tensors", group_size=-1)),
    (ct("ct-w4a16", weights={"actorder": "weight"}), dict(method="compressed-tensors")),
    (ct("ct-fp8-dynamic"), dict(method="fp8", dynamic_activations=True)),
    (ct("ct-fp8"), dict(method="fp8", dynamic_activations=False)),
    # fp8 weight-only: llm-compressor writes naive-quantized when no activations are
    # quantized; the tensors are float-quantized's.
    (ct("ct-fp8", acts=None, format="naive-quantized"),
     dict(method="fp8", dynamic_activations=False)),
])
def test_config_maps_onto_the_existing_methods(quant, want):
    q = resolve_quant("auto", config(quant))
    assert {k: getattr(q, k) for k in want} == want
    assert q.skip_modules == (r"re:lm_head$",)
    assert resolve_quant("compressed-tensors", config(quant)) == q


INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token"}
FP8_GROUP_ACTS = {"num_bits": 8, "type": "float", "dynamic": True, "strategy": "group",
                  "group_size": 128}


@pytest.mark.parametrize(("quant", "needles"), [
    # W8A8 int8 and int8 weight-only
    (ct("ct-fp8", weights={"type": "int", "strategy": "channel"}, acts=INT8,
        format="int-quantized"), ["'int-quantized'", "int 8-bit, channel", "int 8-bit, token"]),
    (ct("ct-fp8", weights={"type": "int", "strategy": "channel"}, acts=None,
        format="naive-quantized"), ["'naive-quantized'", "int 8-bit, channel"]),
    # block-wise fp8 (FP8_BLOCK) and group fp8 weights
    (ct("ct-fp8-dynamic", weights={"strategy": "block", "block_structure": [128, 128]},
        acts=FP8_GROUP_ACTS), ["block [128, 128]", "tensor or channel"]),
    (ct("ct-fp8", weights={"strategy": "group", "group_size": 128}), ["group 128"]),
    # int4 layouts tpserve has no layer for
    (ct("ct-w4a16", weights={"num_bits": 8}), ["int 8-bit, group 32", "pack-quantized"]),
    (ct("ct-w4a16", weights={"strategy": "tensor", "group_size": None}), ["int 4-bit, tensor"]),
    (ct("ct-w4a16", weights={"actorder": "group"}), ["actorder 'group'", "weight_g_idx"]),
    (ct("ct-w4a16", acts={"num_bits": 8, "type": "float", "dynamic": True,
                          "strategy": "token"}), ["4-bit weights with quantized activations"]),
    # activation quantization other than fp8, and fp8 activations tpserve cannot follow
    (ct("ct-fp8", acts=INT8), ["int 8-bit, token", "other than fp8"]),
    (ct("ct-fp8", acts=FP8_GROUP_ACTS), ["float 8-bit, group 128, dynamic"]),
    (ct("ct-fp8", acts={"num_bits": 8, "type": "float", "strategy": "token",
                        "dynamic": "local"}), ["float 8-bit, token"]),
    # formats and schemes
    (ct("ct-w4a16", format="nvfp4-pack-quantized"), ["'nvfp4-pack-quantized'"]),
    (ct("ct-w4a16", format="dense"), ["'dense'"]),
    (ct("ct-w4a16", format="marlin-24"), ["'marlin-24'"]),
    (ct("ct-w4a16", weights={"dynamic": True}), ["dynamic weight scales"]),
    ({**ct(), "config_groups": {**ct()["config_groups"],
                                "group_1": ct("ct-fp8")["config_groups"]["group_0"]}},
     ["2 config_groups (group_0, group_1)"]),
    ({**ct(), "config_groups": {"W4A16": ["Linear"]}}, ["a preset name"]),
    ({**ct(), "config_groups": {}}, ["0 config_groups (none)"]),
    ({**ct(), "config_groups": {"group_0": {**ct()["config_groups"]["group_0"],
                                            "targets": [r"re:.*mlp.*"]}}},
     [r"targets is ['re:.*mlp.*']"]),
    ({**ct(), "config_groups": {"group_0": {**ct()["config_groups"]["group_0"],
                                            "output_activations": INT8}}},
     ["output_activations int 8-bit, token"]),
    # 2:4 sparsity stored compressed, online rotations
    (ct(sparsity_config={"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}),
     ["'sparse-24-bitmask'", "2:4 sparsity"]),
    (ct(transform_config={"config_groups": {"u": {"type": "hadamard"}}}), ["transform_config"]),
    # the LM head quantized too, a broken regex
    (ct(ignore=()), ["quantizes lm_head", "[]"]),
    (ct(ignore=("lm_head", "re:model.layers.(")), ["'re:model.layers.('", "regular expression"]),
])
def test_unsupported_schemes_are_refused_naming_what_the_checkpoint_has(quant, needles):
    with pytest.raises(QuantizationError) as err:
        resolve_quant("auto", config(quant))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_explicit_quantize_must_agree():
    with pytest.raises(QuantizationError, match="says 'compressed-tensors'"):
        resolve_quant("gptq", config(ct()))
    with pytest.raises(QuantizationError, match="no quantization_config"):
        resolve_quant("compressed-tensors", config(None))


def test_dense_stored_sparsity_and_a_kv_cache_scheme_are_served(caplog, monkeypatch):
    """2:4 sparse weights stored dense are plain weights; the kv-cache scales are not read
    (the KV cache follows --kv-cache-dtype), which the log says."""
    monkeypatch.setattr(compressed_tensors, "_NOTED", set())
    q = resolve_quant("auto", config(ct(
        sparsity_config={"format": "dense", "sparsity_structure": "2:4"},
        kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor",
                         "dynamic": False})))
    assert q.method == "compressed-tensors"
    assert "kv_cache_scheme float 8-bit, tensor, static: its k/v scales are not read" \
        in caplog.text


def test_static_activation_scales_are_logged_as_not_applied(caplog, monkeypatch):
    monkeypatch.setattr(compressed_tensors, "_NOTED", set())
    assert not resolve_quant("auto", config(ct("ct-fp8"))).dynamic_activations
    assert "input_scale) are not applied" in caplog.text and "weight-only" in caplog.text


def test_a_tp_that_cuts_a_group_is_refused_naming_weight_packed():
    """o_proj has 128 input features: group 64 gives 2 groups, so tp = 4 would cut one."""
    check_shardable(engine_cfg(2), config(ct(group=64)))
    with pytest.raises(ShardingError) as err:
        check_shardable(engine_cfg(4), config(ct(group=64)))
    msg = str(err.value)
    assert "'model.layers.0.self_attn.o_proj.weight_packed'" in msg
    assert "group size 64" in msg and "tp=4" in msg
    check_shardable(engine_cfg(4), config(ct(group=-1)))  # channel: one group per row


def test_ignoring_part_of_a_fused_layer_is_refused_at_start():
    with pytest.raises(QuantizationError) as err:
        check_shardable(engine_cfg(2), config(ct(ignore=("lm_head",
                                                         "model.layers.0.self_attn.q_proj"))))
    msg = str(err.value)
    assert "['model.layers.0.self_attn.q_proj'] float" in msg
    assert "'model.layers.0.self_attn.k_proj'" in msg and "fused" in msg


@pytest.fixture(scope="module")
def ct_dir(models_dir):
    """name -> (checkpoint, dequantized reference), written once."""
    made: dict[str, tuple] = {}

    def get(name: str, **kwargs):
        if name not in made:
            made[name] = write_quantized(float_checkpoint(models_dir, "llama"),
                                         models_dir / f"ct-{name}",
                                         models_dir / f"ct-{name}-ref", **kwargs)
        return made[name]
    return get


def test_ignored_modules_stay_float_and_the_rest_is_read_by_slice(ct_dir, caplog):
    """At tp = 2 rank 1: modules in ignore (by regex and by name) hold float weights, the
    others packed int4 from weight_packed, of which the rank read half; every checkpoint
    tensor is taken (weight_shape as not needed), none reported ignored."""
    from test_quant_tp import CHECKPOINTS

    path, _ = ct_dir("ignore", **CHECKPOINTS["llama-ct-w4a16-ignore"][1])
    model, stats = load_rank(path, 1, 2)
    assert "ignored" not in caplog.text
    layers = model.model.layers
    for layer in layers:
        assert type(layer.self_attn.o_proj.method) is UnquantizedMethod
        assert layer.self_attn.o_proj.weight.dtype == torch.float32
    assert isinstance(layers[1].mlp.gate_up_proj.method, UnquantizedMethod)
    assert isinstance(layers[0].mlp.gate_up_proj.method, Int4Method)
    for mod in (layers[0].self_attn.qkv_proj, layers[0].mlp.gate_up_proj,
                layers[1].mlp.down_proj):
        assert mod.qweight.dtype == torch.int32 and "weight" not in dict(
            mod.named_parameters(recurse=False))
    for proj in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj"):
        for tensor in ("weight_packed", "weight_scale", "weight_zero_point"):
            assert stats.fraction(f"model.layers.0.{proj}.{tensor}") == pytest.approx(0.5)


def test_fp8_layers_read_the_fp8_tensors(ct_dir):
    path, _ = ct_dir("fp8-static", fmt="ct-fp8")
    model, stats = load_rank(path, 0, 2)
    o = model.model.layers[0].self_attn.o_proj
    assert isinstance(o.method, Fp8Method) and o.weight.dtype == torch.float8_e4m3fn
    assert stats.fraction("model.layers.0.self_attn.o_proj.weight") == pytest.approx(0.5)


def test_the_oracle_is_not_the_float_model_nor_one_without_zero_points(ct_dir, models_dir):
    """The dequantized reference differs from the float model by far more than the 1e-4 the
    served logits must meet, and so does the same checkpoint read without its zero points
    (as a loader that took the scheme for symmetric would): a loader that ignored the
    quantized tensors or a zero point would fail tests/test_quant_tp.py."""
    from safetensors.torch import load_file, save_file

    path, ref = ct_dir("asym", fmt="ct-w4a16", group=32, sym=False)
    want = hf_last_logits(ref, PROMPTS)
    float_logits = hf_last_logits(float_checkpoint(models_dir, "llama"), PROMPTS)
    wrong = models_dir / "ct-asym-zero-8"
    shutil.copytree(ref, wrong, dirs_exist_ok=True)
    weights, packed = load_file(ref / "model.safetensors"), load_file(path / "model.safetensors")
    for name in list(weights):
        if name.endswith(".weight") and f"{name[:-7]}.weight_packed" in packed:
            scales = packed[f"{name[:-7]}.weight_scale"].float()  # [N, G]
            q = _unpack_along_cols(packed[f"{name[:-7]}.weight_packed"])  # [N, K]
            weights[name] = (q - 8) * scales.repeat_interleave(32, dim=1)
    save_file(weights, wrong / "model.safetensors", metadata={"format": "pt"})
    zero_8 = hf_last_logits(wrong, PROMPTS)
    for a, b, c in zip(want, float_logits, zero_8, strict=True):
        scale = a.abs().max().item()
        assert (a - b).abs().max().item() > 1e-2 * scale
        assert (a - c).abs().max().item() > 1e-2 * scale


def _unpack_along_cols(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [R, 8 C]: nibble i of column c is column 8c + i."""
    shifts = torch.arange(0, 32, 4)
    return ((packed.long().unsqueeze(-1) >> shifts) & 0xF).reshape(packed.shape[0], -1).float()


# The writer against the library (optional; the tests above do not need it).
@pytest.mark.parametrize(("fmt", "group", "sym"), [
    ("ct-w4a16", 32, True), ("ct-w4a16", 32, False), ("ct-w4a16", -1, False),
    ("ct-fp8", 0, True), ("ct-fp8-dynamic", 0, True)])
def test_the_writer_agrees_with_the_compressed_tensors_library(fmt, group, sym):
    """The config parses as the library's QuantizationConfig; the library compresses the
    dequantized weight with the writer's scales and zero points into the same tensors, and
    decompresses the writer's tensors into the oracle's weight (rounded to the scales' dtype,
    in which the library computes)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    q = QuantizationConfig.model_validate(ct_quantization_config(fmt, group, sym))
    scheme = q.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(q.format)
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)) * 0.05
    ours: dict = {}
    if fmt == "ct-w4a16":
        qv, zeros, scales, _, deq = quantize_int4(w, group if group > 0 else 128, sym, False,
                                                   0, torch.bfloat16)
        ours["weight_packed"] = pack_along_cols(qv.t())
        ours["weight_scale"] = scales.t().contiguous()
        ours["weight_shape"] = torch.tensor(list(w.shape))
        given = {"weight": deq, "weight_scale": ours["weight_scale"]}
        if not sym:
            ours["weight_zero_point"] = pack_along_rows(zeros.t())
            given["weight_zero_point"] = (zeros.t() - 8).to(torch.int8).contiguous()
    else:  # per tensor: one scale of shape [1]; per channel: [N, 1]
        scale = (w.abs().amax() / 448.0).reshape(1) if fmt == "ct-fp8" else \
            w.abs().amax(dim=1, keepdim=True) / 448.0
        ours["weight"] = (w / scale).to(torch.float8_e4m3fn)
        ours["weight_scale"] = scale
        deq = ours["weight"].float() * scale
        given = {"weight": deq, "weight_scale": scale}
    theirs = compressor.compress(given, scheme)
    assert set(theirs) == set(ours) | ({"input_scale"} & set(theirs))
    for name, t in ours.items():
        got = theirs[name]
        if t.dtype == torch.float8_e4m3fn:
            got, t = got.view(torch.uint8), t.view(torch.uint8)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    back = compressor.decompress(ours, scheme)["weight"]
    torch.testing.assert_close(back.float(), deq.to(back.dtype).float(), rtol=0, atol=0)
