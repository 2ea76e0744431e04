"""fp8 Llama 4 checkpoints served by Ray shard actors against transformers (float32, CPU)
running the same model with the dequantized weights: prefill logits within 1e-4 relative,
32 greedy tokens identical. The checkpoints are written in the test from tests/tiny_models.py's
Llama 4 (4 heads of 16, 2 KV heads, 4 experts of 64) as the fp8 releases store them: every
linear fp8 with a per-channel weight_scale ([N, 1]) or one per tensor, the experts one by one
(feed_forward.experts.{e}.gate_proj / up_proj / down_proj), the router float. q_proj and
k_proj rows are reordered within each head at load (the interleaved rotary), so their
weight_scale rows must be too: the writer spreads those scales by powers of two so that a
loader reordering the weight rows but not the scales is far off (the oracle guard below).
The reference re-fuses the dequantized experts into transformers' experts.gate_up_proj /
down_proj. The int4 checkpoints (GPTQ, AWQ, compressed-tensors; below) are written from a
wider Llama 4 the same way, their q/k int4 tensors reordered at load by
interleaved_rotary.half_order_rows as Cohere's are."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from engine_utils import (
    assert_matches_reference,
    assert_unlike_reference,
    engine_matches_reference,
    load_rank,
    make_engine,
)
from quant_checkpoints import (
    ct_quantization_config,
    unreordered_rows,
    write_fp8_cast_reference,
    write_quantized,
)
from safetensors.torch import load_file, save_file
from tiny_models import FAMILY_CHECKPOINTS, PROMPTS, hf_greedy, hf_last_logits, save_model

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.errors import CheckpointError
from tpserve.layers.interleaved_rotary import half_order
from tpserve.layers.moe import QuantizedExpert
from tpserve.layers.quant.config import QuantizationError
from tpserve.layers.quant.methods import Fp8Method, UnquantizedMethod
from tpserve.worker.build import check_shardable

HEAD_DIM = 16
ROUTER = r"re:.*feed_forward\.router$"
CHECKPOINTS = {
    # the fp8 method: weight_scale per channel [N, 1], input_scale per tensor (not applied)
    "llama4-fp8": dict(fmt="fp8"),
    "llama4-fp8-per-tensor": dict(fmt="fp8", fp8_per_tensor=True),
    # compressed-tensors fp8 per channel, dynamic per-token activations (Maverick FP8's
    # scheme), the router ignored
    "llama4-ct-fp8-dynamic": dict(fmt="ct-fp8-dynamic", ignore=("lm_head", ROUTER)),
    # as above with attention kept float (llm-compressor's Llama 4 recipes ignore self_attn)
    "llama4-ct-fp8-float-attn": dict(fmt="ct-fp8-dynamic",
                                     ignore=("lm_head", ROUTER, r"re:.*self_attn.*")),
}
FAST = {("llama4-fp8", 2), ("llama4-ct-fp8-dynamic", 2)}
CASES = [pytest.param(name, tp, id=f"{name}-tp{tp}",
                      marks=() if (name, tp) in FAST else pytest.mark.slow)
         for name in CHECKPOINTS for tp in (1, 2, 4)]


def float_llama4(models_dir: Path) -> Path:
    out = models_dir / "quant-float-llama4"
    if not (out / "config.json").exists():
        config, kwargs = FAMILY_CHECKPOINTS["llama4"]
        save_model(config(), out, **kwargs)
    return out


def _unfuse(src: Path, out: Path) -> Path:
    """src with each layer's fused experts stored one by one (as the fp8 releases do)."""
    weights = load_file(src / "model.safetensors")
    for name in [n for n in weights if n.endswith(".experts.gate_up_proj")]:
        base = name[: -len("gate_up_proj")]
        gate_up, down = weights.pop(name), weights.pop(base + "down_proj")
        i = gate_up.shape[2] // 2
        for e in range(gate_up.shape[0]):
            weights[f"{base}{e}.gate_proj.weight"] = gate_up[e, :, :i].t().contiguous()
            weights[f"{base}{e}.up_proj.weight"] = gate_up[e, :, i:].t().contiguous()
            weights[f"{base}{e}.down_proj.weight"] = down[e].t().contiguous()
    shutil.copytree(src, out, dirs_exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _refuse(weights: dict) -> dict:
    """The per-expert float tensors fused back into transformers' layout."""
    experts = sorted({n.rpartition(".experts.")[0] for n in weights if ".experts." in n})
    for block in experts:
        e = 0
        gates, ups, downs = [], [], []
        while f"{block}.experts.{e}.gate_proj.weight" in weights:
            p = f"{block}.experts.{e}"
            gates.append(weights.pop(f"{p}.gate_proj.weight").t())
            ups.append(weights.pop(f"{p}.up_proj.weight").t())
            downs.append(weights.pop(f"{p}.down_proj.weight").t())
            e += 1
        weights[f"{block}.experts.gate_up_proj"] = torch.stack(
            [torch.cat((g, u), dim=1) for g, u in zip(gates, ups, strict=True)]).contiguous()
        weights[f"{block}.experts.down_proj"] = torch.stack(downs).contiguous()
    return weights


def _spread_qk_scales(qdir: Path, ref: Path, misread: Path | None = None) -> None:
    """Multiply q_proj / k_proj per-channel scales by 2^0..2^4 (seeded by the name) in the
    checkpoint and its dequantized twin, so neighbouring rows' scales differ by up to 16x.
    misread: also write the twin a loader would serve that reordered the weight rows but
    not the scales (held row j, checkpoint row order[j], scaled by checkpoint row j's)."""
    quant, deq = load_file(qdir / "model.safetensors"), load_file(ref / "model.safetensors")
    wrong = dict(deq)
    order = half_order(HEAD_DIM)
    inverse = torch.argsort(order)
    for name in [n for n in quant if n.endswith(("q_proj.weight_scale", "k_proj.weight_scale"))]:
        scale = quant[name]
        if scale.numel() == 1:
            continue
        g = torch.Generator().manual_seed(sum(map(ord, name)))
        scale = scale * 2.0 ** torch.randint(0, 5, scale.shape, generator=g)
        quant[name] = scale
        base = name[: -len("_scale")]
        q = quant[base].float()
        deq[base] = q * scale
        per_head = scale.view(-1, HEAD_DIM, 1)[:, inverse].reshape(scale.shape)
        wrong[base] = q * per_head
    save_file(quant, qdir / "model.safetensors", metadata={"format": "pt"})
    save_file(deq, ref / "model.safetensors", metadata={"format": "pt"})
    if misread is not None:
        shutil.copytree(ref, misread, dirs_exist_ok=True)
        save_file(wrong, misread / "model.safetensors", metadata={"format": "pt"})


_REFS: dict[str, tuple] = {}


def quantized_llama4(models_dir: Path, name: str) -> tuple:
    """(quantized dir, reference tokens, reference logits, misread twin dir), built once."""
    if name not in _REFS:
        src = _unfuse(float_llama4(models_dir), models_dir / "quant-float-llama4-unfused")
        qdir, ref = write_quantized(src, models_dir / name, models_dir / f"{name}-ref",
                                    **CHECKPOINTS[name])
        misread = models_dir / f"{name}-misread"
        _spread_qk_scales(qdir, ref, misread)
        for d in (ref, misread):
            save_file(_refuse(load_file(d / "model.safetensors")), d / "model.safetensors",
                      metadata={"format": "pt"})
        _REFS[name] = (qdir, hf_greedy(ref, PROMPTS, 32), hf_last_logits(ref, PROMPTS), misread)
    return _REFS[name]


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_fp8_llama4_matches_transformers(models_dir, name, tp):
    path, ref_tokens, ref_logits, _ = quantized_llama4(models_dir, name)
    engine_matches_reference(path, tp, ref_tokens, ref_logits)


def _worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() / y.abs().max().item()
               for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["llama4-fp8", "llama4-ct-fp8-dynamic"])
def test_the_oracle_sees_the_quantization_and_the_scale_order(models_dir, name):
    """Oracle guards: the dequantized model is not the float model; and the model a loader
    would serve that reordered q/k weight rows but not their per-channel scales is 100x the
    tolerance away from the reference, so the comparison above checks the reordering."""
    _, ref_tokens, ref_logits, misread = quantized_llama4(models_dir, name)
    assert _worst(ref_logits, hf_last_logits(float_llama4(models_dir), PROMPTS)) > 1e-2
    assert _worst(hf_last_logits(misread, PROMPTS), ref_logits) > 100 * 1e-4
    assert all(len(set(t)) > 3 for t in ref_tokens)


def test_held_qk_rows_and_scales_are_reordered_together(models_dir):
    """A tp = 2 rank holds q/k's fp8 rows and their scales in each head's rotate-half order:
    weight x scale is the reordered dequantized weight, row for row; v is untouched."""
    path = quantized_llama4(models_dir, "llama4-fp8")[0]
    model, _ = load_rank(path, 1, 2)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8Method)
    quant = load_file(path / "model.safetensors")
    held = qkv.weight.float() * qkv.weight_scale[:, None]
    order = half_order(HEAD_DIM)

    def reordered(proj: str, rows: slice) -> torch.Tensor:
        w = quant[f"model.layers.0.self_attn.{proj}.weight"].float() * \
            quant[f"model.layers.0.self_attn.{proj}.weight_scale"]
        return w[rows].view(-1, HEAD_DIM, w.shape[1])[:, order].reshape(-1, w.shape[1])

    q_rows, kv_rows = qkv.q_size, qkv.kv_size  # rank 1: heads 2-3, KV head 1
    assert torch.equal(held[:q_rows], reordered("q_proj", slice(32, 64)))
    assert torch.equal(held[q_rows:q_rows + kv_rows], reordered("k_proj", slice(16, 32)))
    v = quant["model.layers.0.self_attn.v_proj.weight"].float() * \
        quant["model.layers.0.self_attn.v_proj.weight_scale"]
    assert torch.equal(held[q_rows + kv_rows:], v[16:32])
    assert not torch.equal(held[:q_rows], quant["model.layers.0.self_attn.q_proj.weight"]
                           .float()[32:64] * quant["model.layers.0.self_attn.q_proj.weight_scale"][32:64])


def test_experts_stay_fp8_one_by_one_and_the_router_float(models_dir):
    path = quantized_llama4(models_dir, "llama4-ct-fp8-float-attn")[0]
    model, stats = load_rank(path, 1, 2)
    moe = model.model.layers[1].mlp
    assert moe.w13 is None and all(isinstance(e, QuantizedExpert) for e in moe.experts)
    assert isinstance(moe.experts[3].down_proj.method, Fp8Method)
    assert isinstance(moe.shared_expert.gate_up_proj.method, Fp8Method)
    assert isinstance(model.model.layers[0].mlp.down_proj.method, Fp8Method)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj.method, UnquantizedMethod)
    assert moe.gate.weight.dtype != torch.float8_e4m3fn
    pre = "model.layers.1.feed_forward"
    assert stats.fraction(f"{pre}.experts.3.down_proj.weight") == pytest.approx(0.5)
    assert stats.fraction(f"{pre}.router.weight") == 1


@pytest.mark.parametrize("tp", [2, pytest.param(1, marks=pytest.mark.slow),
                                pytest.param(4, marks=pytest.mark.slow)])
def test_fp8_cast_at_load_matches_transformers(models_dir, tp):
    """--quantize fp8 on the float checkpoint: attention and dense MLPs cast per channel of
    each rank's slice (after q/k's rows are reordered: the same scales, reordered); the
    experts stay float and stacked."""
    src = float_llama4(models_dir)
    ref = write_fp8_cast_reference(src, models_dir / f"llama4-fp8-cast-ref-tp{tp}", tp)
    weights = load_file(ref / "model.safetensors")
    assert any(".experts." in n for n in weights)  # fused experts: not cast by the writer
    ref_logits = hf_last_logits(ref, PROMPTS)
    assert _worst(ref_logits, hf_last_logits(src, PROMPTS)) > 1e-3
    engine = make_engine(src, tp, quantize="fp8", local=tp == 1, forked=tp > 1)
    try:
        assert_matches_reference(engine, PROMPTS, hf_greedy(ref, PROMPTS, 32), ref_logits)
    finally:
        engine.shutdown()


def _cfg(tp: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="m", max_model_len=64),
                        parallel=ParallelConfig(tp_size=tp))


@pytest.mark.parametrize(("quant", "needle"), [
    ({"quant_method": "fp8", "weight_block_size": [8, 32]},
     "blocks of 8 rows cut heads of 16"),
])
def test_what_llama4_does_not_serve_is_refused_at_start(quant, needle):
    hf = FAMILY_CHECKPOINTS["llama4"][0]()
    hf.quantization_config = quant
    with pytest.raises(QuantizationError, match=re.escape(needle)):
        check_shardable(_cfg(2), hf)


def test_fp8_blocks_of_whole_heads_build():
    hf = FAMILY_CHECKPOINTS["llama4"][0]()
    hf.quantization_config = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    check_shardable(_cfg(2), hf)


def test_fused_quantized_experts_are_refused_at_load(models_dir):
    """The fbgemm layout (experts.gate_up_proj fp8 with gate_up_proj_scale) is not read."""
    src = quantized_llama4(models_dir, "llama4-fp8")[0]
    out = models_dir / "llama4-fp8-fused-experts"
    shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    weights["model.layers.1.feed_forward.experts.gate_up_proj"] = torch.zeros(
        4, 64, 128).to(torch.float8_e4m3fn)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts stored fused in a quantized Llama 4"):
        load_rank(out, 0, 1)
    assert json.loads((out / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize(("tensor", "shape", "needle"), [
    ("experts.down_proj", (4, 128, 128), "experts stored fused in a quantized Llama 4"),
    ("router.qweight", (16, 4), "the router is stored quantized")])
def test_int4_fused_experts_and_a_quantized_router_are_refused_at_load(models_dir, tensor,
                                                                        shape, needle):
    src = quantized_llama4_int4(models_dir, "llama4-gptq-actorder")[0]
    out = models_dir / f"llama4-gptq-{tensor.replace('.', '-')}"
    shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    name = f"model.layers.1.feed_forward.{tensor}"
    weights[name] = torch.zeros(shape, dtype=torch.int32 if "qweight" in tensor else None)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=re.escape(f"{name!r}: {needle}") if "router" in
                       tensor else needle):
        load_rank(out, 0, 1)


def test_vision_language_ignore_names_match_the_text_models():
    """Llama4ForConditionalGeneration's compressed-tensors ignore lists may name modules as
    the checkpoint does (language_model.model.layers..., language_model.lm_head): they
    match the text model's names too."""
    from tpserve.layers.quant.compressed_tensors import parse_config
    from tpserve.layers.quant.methods import _skipped

    q = ct_quantization_config("ct-fp8-dynamic", ignore=(
        "language_model.lm_head", "language_model.model.layers.0.self_attn.q_proj",
        "language_model.model.layers.0.self_attn.k_proj",
        "language_model.model.layers.0.self_attn.v_proj", ROUTER))
    cfg = parse_config(q, "auto")
    assert _skipped(cfg, "model.layers.0.self_attn.qkv_proj",
                    [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")])
    assert not _skipped(cfg, "model.layers.1.self_attn.o_proj",
                        ["model.layers.1.self_attn.o_proj"])
    assert _skipped(cfg, "model.layers.1.feed_forward.router",
                    ["model.layers.1.feed_forward.router"])


# int4 (GPTQ, AWQ, compressed-tensors pack-quantized) Llama 4 checkpoints, written in the test
# from a Llama 4 128 wide (4 heads of 32, 2 KV heads replicated at tp = 4; experts of 128 and
# dense layers of 256, whole groups of 32 on every rank at tp = 4), the experts one by one as
# the int4 releases store them, the router float. q_proj's and k_proj's int4 output columns
# (GPTQ's qweight, scales, packed qzeros; AWQ's packed qweight and qzeros; compressed-tensors'
# weight_packed, weight_scale, packed weight_zero_point) are reordered within each head at
# load by interleaved_rotary.half_order_rows, as Cohere's are.
INT4_HEAD_DIM = 32
INT4 = {
    "llama4-gptq-actorder": dict(fmt="gptq", group=32, sym=False, act_order=True),
    "llama4-awq": dict(fmt="awq", group=32, sym=False),  # zero points vary, as AWQ's do
    "llama4-ct-w4a16-asym": dict(fmt="ct-w4a16", group=32, sym=False,
                                 ignore=("lm_head", ROUTER)),
    # Llama4ForConditionalGeneration served as text (language_model.* names; the vision
    # tower, quantized here too, never read)
    "llama4-vlm-gptq": dict(fmt="gptq", group=32, sym=False, act_order=True),
}
# Default job: tp = 1 of every checkpoint in process; tp = 2 and 4 (Ray shard actors, ~25 s
# each on two shared cores) in the slow job: a rank's int4 slice is checked in the default
# job without Ray (test_int4_experts_load_one_by_one_and_the_router_float).
INT4_FAST: set[tuple[str, int]] = set()


def float_llama4_int4(models_dir: Path, family: str = "llama4") -> Path:
    out = models_dir / f"quant-float-{family}-128"
    if not (out / "config.json").exists():
        config, kwargs = FAMILY_CHECKPOINTS[family]
        save_model(config(hidden_size=128, intermediate_size=128, intermediate_size_mlp=256,
                          head_dim=INT4_HEAD_DIM), out, **kwargs)
    return out


def quantized_llama4_int4(models_dir: Path, name: str) -> tuple:
    """(quantized dir, reference tokens, reference logits), built once."""
    if name not in _REFS:
        family = "llama4-vlm" if "-vlm-" in name else "llama4"
        src = _unfuse(float_llama4_int4(models_dir, family),
                      models_dir / f"quant-float-{family}-128-unfused")
        qdir, ref = write_quantized(src, models_dir / name, models_dir / f"{name}-ref",
                                    **INT4[name])
        save_file(_refuse(load_file(ref / "model.safetensors")), ref / "model.safetensors",
                  metadata={"format": "pt"})
        _REFS[name] = (qdir, hf_greedy(ref, PROMPTS, 32), hf_last_logits(ref, PROMPTS))
    return _REFS[name]


def _int4_case(name: str, tp: int):
    fast = tp == 1 or (name, tp) in INT4_FAST
    return pytest.param(name, tp, id=f"{name}-tp{tp}", marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize(("name", "tp"), [_int4_case(n, tp) for n in INT4 for tp in (1, 2, 4)])
def test_int4_llama4_matches_transformers(models_dir, name, tp):
    path, ref_tokens, ref_logits = quantized_llama4_int4(models_dir, name)
    assert all(len(set(t)) > 3 for t in ref_tokens)
    engine_matches_reference(path, tp, ref_tokens, ref_logits)


@pytest.mark.parametrize(("name", "what"), [
    ("llama4-gptq-actorder", "quantized"), ("llama4-awq", "quantized"),
    ("llama4-gptq-actorder", "zeros"), ("llama4-awq", "zeros"),
    ("llama4-ct-w4a16-asym", "zeros")])
def test_serving_int4_without_reordering_qk_fails(models_dir, monkeypatch, name, what):
    """Oracle guard: the same checkpoint loaded with its q/k int4 tensors (or only their
    packed zero points) as stored gives other logits (10-13 off, measured) and other greedy
    tokens on every prompt, so the matches above check each reorder."""
    import tpserve.models.llama4 as llama4

    path, ref_tokens, ref_logits = quantized_llama4_int4(models_dir, name)
    monkeypatch.setattr(llama4, "half_order_rows", unreordered_rows(what))
    assert_unlike_reference(path, ref_tokens, ref_logits)


def test_int4_experts_load_one_by_one_and_the_router_float(models_dir):
    """At tp = 2 every expert (and the shared expert, the dense MLPs, attention) is int4 with
    the checkpoint's method; the router float and whole."""
    from tpserve.layers.quant.methods import Int4Method

    path = quantized_llama4_int4(models_dir, "llama4-awq")[0]
    model, stats = load_rank(path, 1, 2)
    moe = model.model.layers[1].mlp
    assert moe.w13 is None and all(isinstance(e, QuantizedExpert) for e in moe.experts)
    for linear in (moe.experts[3].down_proj, moe.shared_expert.gate_up_proj,
                   model.model.layers[0].mlp.down_proj, model.model.layers[0].self_attn.qkv_proj):
        assert isinstance(linear.method, Int4Method) and linear.method.cfg.method == "awq"
    assert moe.gate.weight.is_floating_point()
    pre = "model.layers.1.feed_forward"
    assert stats.fraction(f"{pre}.experts.3.down_proj.qweight") == pytest.approx(0.5)
    assert stats.fraction(f"{pre}.router.weight") == 1


GPTQ128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
           "sym": True}
AWQ128 = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
          "version": "gemm"}


CT128 = ct_quantization_config("ct-w4a16", 128, True, ("lm_head", ROUTER))


def _size_case(name: str, tp: int, quant: str):
    # Building Maverick's 128 experts a rank takes 4-20 s: one case in the default job.
    fast = (name, tp, quant) == ("scout", 8, "awq")
    return pytest.param(name, tp, quant, id=f"{name}-tp{tp}-{quant}",
                        marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize(("name", "tp", "quant"), [
    _size_case(n, 8, q) for n in ("scout", "maverick") for q in ("gptq", "awq", "ct-w4a16")
    # compressed-tensors groups and packs each row's inputs as GPTQ does (transposed): its
    # groups cut Maverick's slices where GPTQ's do; building 128 experts a rank took ~25 s.
    if (n, q) != ("maverick", "ct-w4a16")])
def test_scout_and_maverick_sizes_build_int4(name, tp, quant):
    """Scout's and Maverick's text dimensions (test_model_shapes.py's) build int4 with groups
    of 128 at tp = 8 (every rank's groups whole: heads, experts' and dense layers'
    intermediate units, o_proj's input). A rank's slice at tp = 8 is a whole number of
    groups only where it is at tp = 2 and 4 too (those slices are 2 and 4 of it)."""
    from test_model_shapes import LLAMA4_SIZES, engine_cfg
    from transformers import Llama4TextConfig

    hf = Llama4TextConfig(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                          num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                          head_dim=128, vocab_size=202048, num_experts_per_tok=1,
                          tie_word_embeddings=False, architectures=["Llama4ForCausalLM"],
                          **LLAMA4_SIZES[name])
    hf.quantization_config = dict({"gptq": GPTQ128, "awq": AWQ128, "ct-w4a16": CT128}[quant])
    check_shardable(engine_cfg(tp), hf)


def test_int4_vision_tower_is_never_read_nor_reordered(models_dir):
    """The vision-language checkpoint's vision tower (int4 here, with a q_proj tensor no
    int4 layout has) is passed over: not reordered, not read."""
    src = quantized_llama4_int4(models_dir, "llama4-vlm-gptq")[0]
    out = models_dir / "llama4-vlm-gptq-odd-vision"
    shutil.copytree(src, out, dirs_exist_ok=True)
    weights = load_file(src / "model.safetensors")
    weights["vision_model.model.layers.0.self_attn.q_proj.input_scale"] = torch.ones(1)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    _, stats = load_rank(out, 0, 2)
    vision = [n for n in stats.full_bytes if n.startswith("vision_model.")]
    assert any(n.endswith("q_proj.qweight") for n in vision)
    assert not any(stats.read_bytes.get(n) for n in vision)
