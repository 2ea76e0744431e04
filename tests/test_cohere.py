"""Cohere's pieces against transformers' modeling_cohere / modeling_cohere2 (float32, CPU):
the interleaved rotary served as rotate-half over reordered q/k rows, the per-head q/k
LayerNorm and its shard per rank, Cohere 2's windows and NoPE layers; and guards showing
that the plausible wrong versions (no reordering, rotary on every Cohere 2 layer) fail.
The tp = 1, 2, 4 matches of whole models are in tests/test_tp_families.py."""

from __future__ import annotations

import pytest
import torch
from engine_utils import load_rank, make_engine, prefill_logits
from tensor_slices import tensor_slice
from tiny_models import PROMPTS, family_checkpoint, hf_last_logits

from tpserve.layers.interleaved_rotary import HalfOrderRows, half_order
from tpserve.layers.rotary import RotaryEmbedding


@pytest.fixture(scope="module")
def checkpoint(models_dir):
    return lambda name: family_checkpoint(models_dir, name)


def _max_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    return max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True))


def test_rotate_half_over_reordered_dims_is_coheres_interleaved_rotary():
    """transformers' Cohere rotary (pairs (2i, 2i + 1)) on q and k equals tpserve's
    rotate-half rotary on the same vectors in half_order, reordered likewise; so q . k, all
    attention reads, is the same."""
    from transformers import CohereConfig
    from transformers.models.cohere.modeling_cohere import (
        CohereRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    d, heads, t = 16, 3, 11
    cfg = CohereConfig(hidden_size=d * heads, num_attention_heads=heads,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    q, k = torch.randn(1, heads, t, d), torch.randn(1, heads, t, d)
    pos = torch.arange(t)[None] * 7
    cos, sin = CohereRotaryEmbedding(cfg)(q, pos)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)

    order = half_order(d)
    ours = RotaryEmbedding(d, 128, {"rope_type": "default", "rope_theta": 10000.0})
    got_q, got_k = ours(pos[0], q[0].transpose(0, 1)[..., order], k[0].transpose(0, 1)[..., order])
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1)[..., order], rtol=1e-5, atol=1e-5)
    scores = torch.einsum("thd,shd->hts", got_q, got_k)
    torch.testing.assert_close(scores, ref_q[0] @ ref_k[0].transpose(1, 2), rtol=1e-4, atol=1e-4)
    # Oracle guard: rotate-half over the checkpoint's own order is another rotation.
    wrong_q, wrong_k = ours(pos[0], q[0].transpose(0, 1), k[0].transpose(0, 1))
    wrong = torch.einsum("thd,shd->hts", wrong_q, wrong_k)
    assert float((wrong - scores).abs().max()) > 0.1


def test_half_order_rows_reads_whole_heads_and_refuses_a_split_one():
    d = 8
    w = torch.randn(4 * d, 5)
    rows = HalfOrderRows(tensor_slice("q_proj.weight", w), d)
    want = w.view(4, d, 5)[:, half_order(d)].reshape(4 * d, 5)
    torch.testing.assert_close(rows.all(), want, rtol=0, atol=0)
    torch.testing.assert_close(rows.narrow(0, 2 * d, d), want[2 * d:3 * d], rtol=0, atol=0)
    with pytest.raises(ValueError, match="splits a head"):
        rows.narrow(0, d // 2, d)
    norm = torch.randn(4, d)
    cols = HalfOrderRows(tensor_slice("q_norm.weight", norm), d,
                         per_head_last=True)
    torch.testing.assert_close(cols.narrow(0, 1, 2), norm[1:3][:, half_order(d)], rtol=0, atol=0)


def test_head_layer_norm_is_coheres_qk_norm():
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    from tpserve.layers.norm import HeadLayerNorm

    torch.manual_seed(0)
    ref = CohereLayerNorm((4, 16), eps=1e-5)
    with torch.no_grad():
        ref.weight.normal_()
    x = torch.randn(5, 4, 16) * 3 + 1
    norm = HeadLayerNorm(4, 2, 2, 16, 1e-5)  # a rank holding heads 2 and 3
    norm.weight.data.copy_(ref.weight[2:])
    got = norm(x[:, 2:].reshape(-1, 16)).view(5, 2, 16)
    torch.testing.assert_close(got, ref(x)[:, 2:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_reads_its_heads_of_q_norm_and_k_norm_reordered(checkpoint, tp):
    """q_norm [4 heads, 16] and k_norm [2 KV heads, 16]: rank r holds its q heads' rows and
    its KV head's (replicated at tp = 4), each in half_order like its q_proj / k_proj rows."""
    from safetensors.torch import load_file

    path = checkpoint("cohere-qk-norm")
    full = load_file(str(path / "model.safetensors"))
    pre, d, order = "model.layers.1.self_attn", 16, half_order(16)
    for rank in range(tp):
        model, _ = load_rank(path, rank, tp)
        attn = model.model.layers[1].self_attn
        nq, nkv, kv0 = 4 // tp, max(1, 2 // tp), rank * 2 // tp
        q_heads = slice(rank * nq, (rank + 1) * nq)
        torch.testing.assert_close(attn.q_norm.weight, full[f"{pre}.q_norm.weight"][q_heads][:, order],
                                   rtol=0, atol=0)
        torch.testing.assert_close(attn.k_norm.weight,
                                   full[f"{pre}.k_norm.weight"][kv0:kv0 + nkv][:, order],
                                   rtol=0, atol=0)
        q = full[f"{pre}.q_proj.weight"].view(4, d, -1)[q_heads][:, order].reshape(nq * d, -1)
        torch.testing.assert_close(attn.qkv_proj.weight[:nq * d], q, rtol=0, atol=0)


def test_cohere2_windows_and_positions_per_layer(checkpoint):
    """Three sliding layers (window 8, rotary) then one full-attention layer with neither,
    as transformers' sliding_window_pattern 4; the tied head is the embedding."""
    model, _ = load_rank(checkpoint("cohere2"), 0, 1)
    layers = model.model.layers
    assert [layer.self_attn.attn.spec.sliding_window for layer in layers] == [8, 8, 8, None]
    assert [layer.rotary for layer in layers] == [True, True, True, False]
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_serving_without_the_reordering_fails(checkpoint, monkeypatch):
    """Oracle guard: the same model loaded with q_proj / k_proj rows as stored (rotate-half
    over interleaved pairs, the plausible mistake) gives other logits than transformers."""
    import tpserve.models.cohere as cohere

    path = checkpoint("cohere")
    ref = hf_last_logits(path, PROMPTS)
    monkeypatch.setattr(cohere, "_with_half_order", lambda tensors, *_: tensors)
    engine = make_engine(path, 1, local=True)
    try:
        assert _max_diff(prefill_logits(engine, PROMPTS), ref) > 0.05
    finally:
        engine.shutdown()


def test_rotary_on_coheres2_full_layer_changes_the_reference(checkpoint):
    """Oracle guard: transformers' Cohere 2 with rotary on its full-attention layer too (the
    plausible mistake of rotating every layer; its mask stays full) gives other logits, so
    the served match checks that layer goes without positions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoint("cohere2")
    ref = hf_last_logits(path, PROMPTS)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        same = [model(tok(p, return_tensors="pt").input_ids).logits[0, -1] for p in PROMPTS]
        model.model.layers[3].self_attn.sliding_window = 10**6  # rotates; eager keeps the mask
        got = [model(tok(p, return_tensors="pt").input_ids).logits[0, -1] for p in PROMPTS]
    assert _max_diff(same, ref) < 1e-4
    assert _max_diff(got, ref) > 0.05
