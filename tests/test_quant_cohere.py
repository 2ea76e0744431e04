"""GPTQ, AWQ and compressed-tensors int4 Cohere and Cohere 2 checkpoints served at tp = 1, 2, 4
against transformers (float32, CPU) running the same model with the dequantized weights:
prefill logits within 1e-4 relative, 32 greedy tokens identical. The checkpoints are written
in the test (tests/quant_checkpoints.py) from tiny Cohere models 128 wide (4 heads of 32, 2
KV heads replicated at tp = 4, group size 32): Command-R's layer, with Command-R+'s q/k
norms, and Cohere 2's sliding and position-free layers with q/k/v/o biases.

Cohere's rotary is interleaved, so tpserve reorders q_proj's and k_proj's output features
within each head at load (layers/interleaved_rotary.py); for int4 that is a column
permutation of GPTQ's qweight and scales, and an unpack / permute / repack of every tensor
packed along the output features (GPTQ's qzeros, AWQ's qweight and qzeros in AWQ's nibble
order, compressed-tensors' weight_zero_point). The guards show that a loader skipping those
reorders (all of them, or only the packed zeros) serves other logits."""

from __future__ import annotations

import pytest
import torch
from engine_utils import (
    assert_unlike_reference,
    assert_varied,
    engine_matches_reference,
    load_rank,
)
from quant_checkpoints import (
    AWQ_ORDER,
    pack_along_cols,
    pack_along_rows,
    quantized_with_reference,
    unreordered_rows,
)
from safetensors.torch import load_file
from tensor_slices import tensor_slice

from tpserve.errors import CheckpointError
from tpserve.layers.interleaved_rotary import HalfOrderRows, half_order, half_order_rows

HEAD_DIM = 32
# name -> (family, write_quantized kwargs)
CHECKPOINTS = {
    "cohere-gptq-sym": ("cohere", dict(fmt="gptq", group=32, sym=True)),
    "cohere-gptq-actorder": ("cohere", dict(fmt="gptq", group=32, sym=False, act_order=True)),
    "cohere-qk-norm-gptq-sym": ("cohere-qk-norm", dict(fmt="gptq", group=32, sym=True)),
    "cohere-awq": ("cohere", dict(fmt="awq", group=32)),
    "cohere-ct-w4a16-asym": ("cohere", dict(fmt="ct-w4a16", group=32, sym=False)),
    "cohere2-gptq-actorder": ("cohere2", dict(fmt="gptq", group=32, sym=False, act_order=True)),
    "cohere2-awq": ("cohere2", dict(fmt="awq", group=32)),
    "cohere2-ct-w4a16": ("cohere2", dict(fmt="ct-w4a16", group=32, sym=True)),
}
# Default job: tp = 1 of every checkpoint in process (no Ray) and one case at tp = 2 through
# Ray shard actors (~25 s on two shared cores); the rest in the slow job.
FAST = {("cohere-gptq-actorder", 2)}


def _case(name: str, tp: int):
    fast = tp == 1 or (name, tp) in FAST
    return pytest.param(name, tp, id=f"{name}-tp{tp}", marks=() if fast else pytest.mark.slow)


@pytest.fixture(scope="module")
def quantized(models_dir):
    """name -> (quantized dir, reference tokens, reference logits), built once."""
    return lambda name: quantized_with_reference(models_dir, name, *CHECKPOINTS[name])


@pytest.mark.parametrize(("name", "tp"),
                         [_case(name, tp) for name in CHECKPOINTS for tp in (1, 2, 4)])
def test_quantized_cohere_matches_transformers(quantized, name, tp):
    path, ref_tokens, ref_logits = quantized(name)
    engine_matches_reference(path, tp, ref_tokens, ref_logits)


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_continuations_are_not_degenerate(quantized, name):
    _, ref_tokens, _ = quantized(name)
    assert_varied(ref_tokens)


@pytest.mark.parametrize(("name", "what"), [("cohere-gptq-actorder", "quantized"),
                                            ("cohere-awq", "quantized"),
                                            ("cohere-gptq-actorder", "zeros"),
                                            ("cohere-ct-w4a16-asym", "zeros")])
def test_serving_without_reordering_the_int4_rows_fails(quantized, monkeypatch, name, what):
    """Oracle guard: the same checkpoint loaded with its q/k int4 tensors (or only their
    packed zero points) as stored gives other logits than transformers and other greedy
    tokens, so the matches above check each reorder."""
    import tpserve.models.cohere as cohere

    path, ref_tokens, ref_logits = quantized(name)
    monkeypatch.setattr(cohere, "half_order_rows", unreordered_rows(what))
    # logits 2.3-3.6 off, measured
    assert_unlike_reference(path, ref_tokens, ref_logits)


def _slice(name: str, t: torch.Tensor):
    return tensor_slice(name, t, "I32")


@pytest.mark.parametrize(("fmt", "tensor"), [("gptq", "qzeros"), ("awq", "qweight"),
                                             ("awq", "qzeros"),
                                             ("compressed-tensors", "weight_zero_point")])
def test_packed_rows_are_reordered_per_head_and_read_per_rank(fmt, tensor):
    """A tensor packing 8 output features a word, written by the test's own packer
    (quant_checkpoints.py) from nibbles q [rows, 4 heads * 32]: read whole or as a rank's
    two heads, it is the packing of q with each head's columns in half_order."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (6, 4 * HEAD_DIM), generator=g)
    order = (torch.arange(0, 4 * HEAD_DIM, HEAD_DIM)[:, None] + half_order(HEAD_DIM)).flatten()
    if fmt == "compressed-tensors":  # [N / 8, rows]: output 8r + i in nibble i of row r
        stored, want = pack_along_rows(q.t()), pack_along_rows(q[:, order].t())
        dim = 0
    else:
        awq = AWQ_ORDER if fmt == "awq" else tuple(range(8))
        stored, want = pack_along_cols(q, awq), pack_along_cols(q[:, order], awq)
        dim = 1
    rows = half_order_rows(_slice(f"model.layers.0.self_attn.k_proj.{tensor}", stored),
                           HEAD_DIM, fmt)
    torch.testing.assert_close(rows.all(), want, rtol=0, atol=0)
    words = HEAD_DIM // 8  # a head's words along dim
    torch.testing.assert_close(rows.narrow(dim, 2 * words, 2 * words),
                               want.narrow(dim, 2 * words, 2 * words), rtol=0, atol=0)
    with pytest.raises(ValueError, match="splits a head"):
        rows.narrow(dim, words // 2, words)


def test_unknown_quantized_q_tensor_and_odd_head_dim_are_refused():
    t = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(CheckpointError, match="weight_g_idx"):
        half_order_rows(_slice("model.layers.0.self_attn.q_proj.weight_g_idx", t), 32,
                        "compressed-tensors")
    with pytest.raises(CheckpointError, match="multiple of 8"):
        HalfOrderRows(_slice("model.layers.0.self_attn.q_proj.qzeros", t), 12, packed="gptq")


@pytest.mark.parametrize("name", ["cohere-gptq-actorder", "cohere-awq", "cohere-ct-w4a16-asym"])
def test_rank_holds_its_heads_reordered_and_reads_its_slice(quantized, models_dir, name):
    """At tp = 2 rank 1 holds q heads 2 and 3 and KV head 1: its int4 qkv_proj, dequantized,
    is the reference's q_proj / k_proj rows of those heads in half_order (v_proj as stored),
    and it read half of each q_proj / k_proj tensor."""
    from tpserve.kernels.quant.torch_ref import dequantize_int4

    path = quantized(name)[0]
    ref = load_file(str(models_dir / f"{name}-ref" / "model.safetensors"))
    model, stats = load_rank(path, 1, 2)
    qkv = model.model.layers[0].self_attn.qkv_proj
    g_idx = qkv.g_idx if qkv.method.cfg.desc_act else None
    w = dequantize_int4(qkv.qweight.contiguous(), qkv.scales.float(), qkv.qzeros.float(),
                        qkv.method.group, g_idx).t()
    pre, d = "model.layers.0.self_attn", HEAD_DIM
    order = half_order(d)

    def heads(proj, start, n):
        return ref[f"{pre}.{proj}.weight"].view(-1, d, 128)[start:start + n][:, order] \
            .reshape(n * d, 128)
    want = torch.cat([heads("q_proj", 2, 2), heads("k_proj", 1, 1),
                      ref[f"{pre}.v_proj.weight"][d:2 * d]])
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-6)
    packed = "weight_packed" if "-ct-" in name else "qweight"
    for proj in ("q_proj", "k_proj"):
        assert stats.fraction(f"{pre}.{proj}.{packed}") == pytest.approx(0.5)


GPTQ128 = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
           "sym": True}
AWQ128 = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
          "version": "gemm"}


@pytest.mark.parametrize(("arch", "quant", "tp"), [
    ("CohereForCausalLM", GPTQ128, 8), ("CohereForCausalLM", AWQ128, 4),
    ("Cohere2ForCausalLM", AWQ128, 8), ("Cohere2ForCausalLM", GPTQ128, 2)])
def test_command_r_plus_and_command_a_sizes_build_quantized(arch, quant, tp):
    """Command R+'s and Command A's dimensions (test_model_shapes.py's: 96 heads / 8 KV heads
    of 128, hidden 12288) build int4 at tp up to 8 (every rank's groups whole); fp8
    checkpoints are refused naming the family and --quantize fp8."""
    from test_model_shapes import COHERE_SIZES, engine_cfg
    from transformers import Cohere2Config, CohereConfig

    from tpserve.layers.quant.config import QuantizationError
    from tpserve.worker.build import check_shardable

    kind = CohereConfig if arch == "CohereForCausalLM" else Cohere2Config
    hf = kind(num_attention_heads=96, num_key_value_heads=8, num_hidden_layers=64,
              vocab_size=256000, architectures=[arch], **COHERE_SIZES[arch])
    hf.quantization_config = dict(quant)
    check_shardable(engine_cfg(tp), hf)
    hf.quantization_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    with pytest.raises(QuantizationError, match=f"{arch}.*fp8.*--quantize fp8"):
        check_shardable(engine_cfg(tp), hf)
