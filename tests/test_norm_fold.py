"""Input norms folded into the QKV projections (LlamaModel.fold_norms): a single stream's
steps normalise inside the QKV projection and add the MLP's output to the residual stream
inside down_proj, with one norm launch a layer instead of two; steps of several rows run
the input norm with a unit weight. Checked on the CPU against transformers (float32): prefill logits of several
prompts, and greedy continuations of one prompt at a time, whose decode steps are one row
and take the folded path (counted). Gemma brings the (1 + w) norm and the tanh GELU, Qwen2
a QKV bias, Granite (residual_multiplier 1, which the fold needs) its embedding, attention
and logits multipliers; their tiny checkpoints have perturbed norm weights, so a fold that lost or
doubled a weight changes the tokens (the guard below shows it does)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_matches_reference, greedy, make_engine
from tiny_models import PROMPTS, family_checkpoint, hf_greedy, hf_last_logits

from tpserve.models.llama import LlamaDecoderLayer

FAMILIES = ("qwen2", "gemma", "granite-fold")


@pytest.fixture(scope="module")
def references(models_dir):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            path = family_checkpoint(models_dir, name)
            cache[name] = (path, hf_greedy(path, PROMPTS, 24), hf_last_logits(path, PROMPTS))
        return cache[name]

    return get


def _folded_engine(path):
    """An in-process tp = 1 engine whose model had its norms folded (without the GEMV's
    warmup choice, which the CPU does not make: the torch reference path runs instead)."""
    engine = make_engine(path, 1, local=True)
    model = engine.executor.worker.model
    assert model.fold_norms(need_gemv=False) is None
    return engine, model


def _one_row_runs(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = LlamaDecoderLayer.forward_folded

    def counted(self, rope, h):
        calls.append(h.shape[0])
        return real(self, rope, h)

    monkeypatch.setattr(LlamaDecoderLayer, "forward_folded", counted)
    return calls


@pytest.mark.parametrize("name", FAMILIES)
def test_folded_norms_match_transformers(references, monkeypatch, name):
    path, ref_tokens, ref_logits = references(name)
    calls = _one_row_runs(monkeypatch)
    engine, model = _folded_engine(path)
    try:
        layer = model.model.layers[0]
        offset = layer.input_layernorm.offset
        assert torch.all(layer.input_layernorm.weight + offset == 1.0)
        # Several prompts: multi-row steps with unit-weight norms.
        assert_matches_reference(engine, PROMPTS, [t[:4] for t in ref_tokens], ref_logits)
        calls.clear()
        for prompt, want in zip(PROMPTS, ref_tokens, strict=True):
            assert greedy(engine, [prompt], len(want)) == [want]
        layers = len(model.model.layers)
        # Every decode step of one stream went through the folded layers, one row each.
        assert len(calls) >= layers * (len(ref_tokens[0]) - 1) * len(PROMPTS)
        assert set(calls) == {1}
    finally:
        engine.shutdown()


def test_a_fold_that_drops_the_weights_changes_the_tokens(references, monkeypatch):
    """The guard: folding that only reset the norms (lost their weights) must fail the check
    above, else the perturbed norm weights would not be what the test relies on."""
    from tpserve.layers.norm import RMSNorm

    path, ref_tokens, _ = references("qwen2")
    monkeypatch.setattr(RMSNorm, "fold_into",
                        lambda self, *linears: self.weight.data.fill_(1.0 - self.offset))
    engine, _ = _folded_engine(path)
    try:
        got = [greedy(engine, [p], len(t))[0] for p, t in zip(PROMPTS, ref_tokens, strict=True)]
        assert got != ref_tokens
    finally:
        engine.shutdown()


def test_fold_is_refused_where_it_cannot_help(models_dir, llama_dir):
    """Expert layers, and (by default) projections warmup left on the vendor GEMM, keep
    their norms: fold_norms says why and changes nothing."""
    engine = make_engine(llama_dir, 1, local=True)
    try:
        model = engine.executor.worker.model
        before = model.model.layers[0].input_layernorm.weight.clone()
        why = model.fold_norms()
        assert why == "layer 0: qkv_proj: warmup kept the vendor GEMM"
        assert not model.model.norms_folded
        assert torch.equal(model.model.layers[0].input_layernorm.weight, before)
    finally:
        engine.shutdown()
    engine = make_engine(family_checkpoint(models_dir, "mixtral"), 1, local=True)
    try:
        why = engine.executor.worker.model.fold_norms(need_gemv=False)
        assert why == "layer 0: its feed-forward block is a SparseMoE, not a gated MLP"
    finally:
        engine.shutdown()


def test_fold_into_moves_the_weight():
    from tpserve.layers.norm import RMSNorm

    for offset in (0.0, 1.0):
        norm = RMSNorm(8, 1e-6, offset, offset == 0.0)
        norm.weight.data = torch.randn(8)
        lin = torch.nn.Linear(8, 5, bias=False)
        x = torch.randn(3, 8)
        want = lin(norm(x))
        norm.fold_into(lin)
        assert torch.all(norm.weight + offset == 1.0)
        torch.testing.assert_close(lin(norm(x)), want, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match="cannot fold a norm of 8"):
            norm.fold_into(torch.nn.Linear(4, 5))


@pytest.mark.parametrize("name", ["qwen2-gptq-actorder", "llama-gptq-sym"])
def test_int4_folded_norms_match_transformers(models_dir, monkeypatch, name):
    """int4 QKV projections take the norm without absorbing its weight (group scales cannot
    hold a per-input weight): the norm keeps its weight for steps of several rows, and a
    one-row step applies it inside QKV's matmul (on the CPU the torch reference path: the
    norm, then the matmul; the GPU's one launch is checked in tests/kernels and
    test_int4_gpu). Greedy one-row continuations and multi-row prefill logits against
    transformers on the dequantized weights."""
    from quant_checkpoints import write_quantized
    from test_quant_tp import CHECKPOINTS, float_checkpoint

    family, kwargs = CHECKPOINTS[name]
    qdir, ref = write_quantized(float_checkpoint(models_dir, family), models_dir / f"fold-{name}",
                                models_dir / f"fold-{name}-ref", **kwargs)
    ref_tokens, ref_logits = hf_greedy(ref, PROMPTS, 16), hf_last_logits(ref, PROMPTS)
    calls = _one_row_runs(monkeypatch)
    engine = make_engine(qdir, 1, local=True)
    try:
        model = engine.executor.worker.model
        before = model.model.layers[0].input_layernorm.weight.clone()
        assert model.fold_norms(need_gemv=False) is None
        assert torch.equal(model.model.layers[0].input_layernorm.weight, before)
        assert_matches_reference(engine, PROMPTS, [t[:4] for t in ref_tokens], ref_logits)
        calls.clear()
        for prompt, want in zip(PROMPTS, ref_tokens, strict=True):
            assert greedy(engine, [prompt], len(want)) == [want]
        assert calls and set(calls) == {1}
    finally:
        engine.shutdown()
