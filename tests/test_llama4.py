"""Llama 4 served as text: Llama4ForCausalLM and the Llama4ForConditionalGeneration wrapper
(transformers runs the whole vision-language model on input_ids alone) at tp = 1, 2, 4 against
transformers float32 on the CPU (prefill logits within 1e-4 relative, 32 greedy tokens
identical), on the tiny checkpoint of tests/tiny_models.py llama4_config: RoPE and NoPE
layers, dense and expert layers, chunks of 8 positions shorter than the prompts, temperature
tuning that bites at the test's positions. Also: chunked attention in the torch backend
against transformers' chunked mask (prefill, a mixed step, decode across a chunk boundary),
the IPEX backend declining it (the Triton kernels' own checks: tests/kernels/), oracle guards (each feature moves transformers'
logits, and so do the plausible wrong readings: sigmoid on the experts' output, gate and up
swapped, rotate-half instead of interleaved pairs), sharding, config and quantization
refusals, each rank's slice of the fused experts, the vision tower never read, mixed steps in
captured pieces (CPU replay), prefix caching across chunks, two all-reduces a layer and the
norm fold declined."""

from __future__ import annotations

import pytest
import torch
from engine_utils import (
    assert_ipex_declines_and_triton_takes,
    assert_varied,
    engine_matches_reference,
    make_engine,
)
from tiny_models import PROMPTS, family_checkpoint, hf_greedy, hf_last_logits, llama4_config

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.errors import ShardingError
from tpserve.kernels.base import AttentionMetadata, AttentionSpec
from tpserve.kernels.capabilities import CHUNKED_REASON
from tpserve.kernels.torch_backend import TorchAttentionBackend
from tpserve.worker.build import check_shardable

CPU = torch.device("cpu")
NAMES = ("llama4", "llama4-vlm")
# tp = 4 splits as tp = 2 does, over more ranks: slow job (each case starts tp Ray actors);
# so does the vision wrapper at tp = 2, whose text model llama4-tp2 splits in the default job.
CASES = [pytest.param(n, tp, id=f"{n}-tp{tp}",
                      marks=pytest.mark.slow if tp == 4 or (n, tp) == ("llama4-vlm", 2) else ())
         for n in NAMES for tp in (1, 2, 4)]

_refs: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def family(models_dir):
    """name -> (checkpoint dir, reference tokens, reference logits), built once."""

    def get(name: str):
        if name not in _refs:
            path = family_checkpoint(models_dir, name)
            _refs[name] = (path, hf_greedy(path, PROMPTS, 32), hf_last_logits(path, PROMPTS))
        return _refs[name]

    yield get
    _refs.clear()


@pytest.mark.parametrize(("name", "tp"), CASES)
def test_llama4_matches_transformers(family, name, tp):
    path, ref_tokens, ref_logits = family(name)
    engine_matches_reference(path, tp, ref_tokens, ref_logits)


@pytest.mark.parametrize("name", NAMES)
def test_continuations_are_not_degenerate(family, name):
    _, ref_tokens, _ = family(name)
    assert_varied(ref_tokens)


def test_prompts_cross_chunks(family):
    """Guards the fixture: the longest prompt spans more than two chunks of 8 on the RoPE
    layers, and on the NoPE layer the temperature (floor_scale 4) changes within it."""
    from transformers import AutoTokenizer

    path, _, _ = family("llama4")
    tok = AutoTokenizer.from_pretrained(path)
    assert max(len(tok(p).input_ids) for p in PROMPTS) > 2 * 8
    cfg = llama4_config()
    assert cfg.layer_types.count("chunked_attention") == 3
    assert cfg.no_rope_layers == [1, 1, 0, 1] and cfg.moe_layers == [1, 3]


# --- chunked attention in the torch backend -------------------------------------------------

def _reference_attention(q, k, v, chunk, scale):
    """transformers' Llama 4 eager attention under its chunked causal mask (masking_utils), one
    sequence: q [L, H, D], k/v [L, KV, D]."""
    from types import SimpleNamespace

    from transformers.masking_utils import chunked_causal_mask_function
    from transformers.models.llama4.modeling_llama4 import eager_attention_forward

    n, groups = q.shape[0], q.shape[1] // k.shape[1]
    pos = torch.arange(n)
    visible = chunked_causal_mask_function(chunk, torch.zeros(1, dtype=torch.long))(
        0, 0, pos[:, None], pos[None, :])
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
    module = SimpleNamespace(num_key_value_groups=groups, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scale)
    return out[0]  # [L, H, D]


def test_torch_backend_chunked_attention_matches_transformers():
    """Two sequences over a paged cache of 4-token blocks, chunks of 6: a mixed step (a
    13-token prefill and a decode row at position 9), then decode rows at 13 and 12 (the
    first of its chunk: it sees itself only) in one batch. Each output row is transformers'
    attention under its chunked mask; without chunks it is not."""
    torch.manual_seed(0)
    heads, kv, d, block, chunk = 4, 2, 16, 4, 6
    spec = AttentionSpec(heads, kv, d, d**-0.5, block_size=block, attention_chunk=chunk)
    lens = [14, 13]
    q = [torch.randn(n, heads, d) for n in lens]
    k = [torch.randn(n, kv, d) for n in lens]
    v = [torch.randn(n, kv, d) for n in lens]
    backend = TorchAttentionBackend()
    k_cache, v_cache = torch.zeros(16, block, kv, d), torch.zeros(16, block, kv, d)
    tables = torch.tensor([[0, 1, 2, 3], [8, 9, 10, 11]], dtype=torch.int32)
    for i, n in enumerate(lens):
        slots = tables[i, torch.arange(n) // block].long() * block + torch.arange(n) % block
        k_cache.view(-1, kv, d)[slots] = k[i]
        v_cache.view(-1, kv, d)[slots] = v[i]
    want = [_reference_attention(q[i], k[i], v[i], chunk, spec.scale) for i in range(2)]

    def meta(q_lens, seq_lens):
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32),
                                 tables[:len(q_lens)],
                                 torch.zeros(sum(q_lens), dtype=torch.long), max(q_lens),
                                 max(seq_lens), tuple(q_lens), tuple(seq_lens))

    step = torch.cat([q[0][:13], q[1][9:10]])
    got = backend.forward(step, k_cache, v_cache, meta([13, 1], [13, 10]), spec)
    torch.testing.assert_close(got[:13], want[0][:13], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[13], want[1][9], rtol=1e-5, atol=1e-5)
    rows = torch.stack([q[0][13], q[1][12]])
    got = backend.forward(rows, k_cache, v_cache, meta([1, 1], [14, 13]), spec)
    torch.testing.assert_close(got, torch.stack([want[0][13], want[1][12]]), rtol=1e-5,
                               atol=1e-5)
    # Position 12 opens a chunk: its output is its own value (per KV head).
    torch.testing.assert_close(got[1], v[1][12].repeat_interleave(heads // kv, 0))
    plain = backend.forward(rows, k_cache, v_cache, meta([1, 1], [14, 13]),
                            AttentionSpec(heads, kv, d, d**-0.5, block_size=block))
    assert float((plain - got).abs().max()) > 0.05


def test_ipex_declines_chunks_and_triton_has_them():
    """auto passes IPEX over naming the reason, and an explicit --kernel ipex is refused with
    it; a plugin backend declines chunks too. Triton runs them (its kernels are checked under
    the interpreter in tests/kernels/): here it declines for the device only."""
    from dataclasses import replace

    from tpserve.kernels.capabilities import unknown_feature_reason

    spec = AttentionSpec(4, 2, 16, 0.25, block_size=4, attention_chunk=8)
    assert "chunked" in spec.features
    assert "chunked" in unknown_feature_reason(spec)  # a plugin backend declines it too
    assert_ipex_declines_and_triton_takes(spec, replace(spec, attention_chunk=None),
                                          CHUNKED_REASON)


# --- oracle guards ----------------------------------------------------------------------------

def _hf_model(path, **override):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **override).eval()


def _logits(model, path) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(tok(p, return_tensors="pt").input_ids).logits[0, -1] for p in PROMPTS]


def _moved(got, ref) -> float:
    return max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True))


FEATURES = [
    {"attention_chunk_size": 4096},  # chunks longer than any sequence: plain causal
    {"attn_temperature_tuning": False},
    {"use_qk_norm": False},
    {"no_rope_layers": [1, 1, 1, 1]},  # the NoPE layer rotates
    {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},  # no llama3
]


@pytest.mark.parametrize("override", FEATURES, ids=[next(iter(o)) for o in FEATURES])
def test_each_feature_changes_the_reference(family, override):
    path, _, ref_logits = family("llama4")
    assert _moved(_logits(_hf_model(path, **override), path), ref_logits) > 0.05


def _sigmoid_on_output(moe, hidden):
    """What scaling each expert's output (Mixtral's way) instead of its input computes."""
    x = hidden.reshape(-1, moe.hidden_dim)
    scores, _ = moe.router(x)  # [tokens, experts]
    routed = moe.experts(x.repeat(scores.shape[1], 1)).view(scores.shape[1], -1, x.shape[-1])
    return moe.shared_expert(x) + (routed * scores.t().unsqueeze(-1)).sum(0), None


def _rotate_half(xq, xk, freqs_cis):
    """Llama's rotate-half rotary with Llama 4's frequencies (pairs (i, i + d/2))."""
    cos = torch.cat([freqs_cis.real] * 2, -1)[:, :, None]
    sin = torch.cat([freqs_cis.imag] * 2, -1)[:, :, None]

    def rot(x):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    return rot(xq), rot(xk)


def test_plausible_misreadings_change_the_reference(family, monkeypatch):
    """The routing weight on the experts' output, gate and up read in the other order, and
    the rotary over halves instead of interleaved pairs each move transformers' logits."""
    from transformers.models.llama4 import modeling_llama4 as m

    path, _, ref_logits = family("llama4")
    with monkeypatch.context() as p:
        p.setattr(m.Llama4TextMoe, "forward", _sigmoid_on_output)
        assert _moved(_logits(_hf_model(path), path), ref_logits) > 0.05
    model = _hf_model(path)
    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer.feed_forward, "experts"):
                w = layer.feed_forward.experts.gate_up_proj
                w.copy_(torch.cat(w.chunk(2, -1)[::-1], -1))
    assert _moved(_logits(model, path), ref_logits) > 0.05
    with monkeypatch.context() as p:
        p.setattr(m, "apply_rotary_emb", _rotate_half)
        assert _moved(_logits(_hf_model(path), path), ref_logits) > 0.05


# --- refusals ---------------------------------------------------------------------------------

def _engine_cfg(tp: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                        parallel=ParallelConfig(tp_size=tp))


REFUSED = [
    ({}, 3, ["'model.layers.0.self_attn.q_proj.weight'", "[64, 64]", "tp=3",
             "attention heads = 4 is not divisible by 3"]),
    ({"intermediate_size": 66}, 4,
     ["'model.layers.1.feed_forward.experts.gate_up_proj'", "[4, 64, 132]", "tp=4",
      "expert intermediate size = 66 is not divisible by 4"]),
    ({"intermediate_size_mlp": 130}, 4,
     ["'model.layers.0.feed_forward.gate_proj.weight'", "[130, 64]", "tp=4",
      "intermediate size = 130 is not divisible by 4"]),
]


@pytest.mark.parametrize(("overrides", "tp", "needles"), REFUSED,
                         ids=[f"{next(iter(o), 'heads')}-tp{tp}" for o, tp, _ in REFUSED])
def test_impossible_tp_is_refused_naming_the_tensor(overrides, tp, needles):
    from tiny_models import llama4_vlm_config

    for config in (llama4_config(**overrides), llama4_vlm_config(**overrides)):
        from tpserve.hf_config import text_only

        with pytest.raises(ShardingError) as err:
            check_shardable(_engine_cfg(tp), text_only(config))
        for needle in needles:
            assert needle in str(err.value), str(err.value)


def test_a_rope_type_that_rescales_is_refused():
    """YaRN scales cos and sin, so the qk norm would not commute with the rotary."""
    yarn = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
            "original_max_position_embeddings": 64}
    with pytest.raises(ValueError, match="rope_type 'yarn' is not supported"):
        check_shardable(_engine_cfg(1), llama4_config(rope_parameters=yarn))


def test_an_int4_checkpoint_builds_at_start():
    """q/k rows are reordered per head at load, int4's packed output columns too
    (interleaved_rotary.half_order_rows): a GPTQ checkpoint is not refused (served against
    transformers: tests/test_quant_llama4.py)."""
    cfg = llama4_config()
    cfg.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 32,
                               "desc_act": False}
    check_shardable(_engine_cfg(2), cfg)


# --- loading ----------------------------------------------------------------------------------

def test_the_vision_tower_is_never_read(models_dir):
    from engine_utils import load_rank

    path = family_checkpoint(models_dir, "llama4-vlm")
    _, stats = load_rank(path, 0, 2)
    vision = [n for n in stats.full_bytes if n.startswith(("vision_model.",
                                                           "multi_modal_projector."))]
    assert vision and not any(stats.read_bytes.get(n) for n in vision)


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_reads_its_slice_of_the_fused_experts(models_dir, tp):
    """gate_up_proj [experts, hidden, (gate; up)] and down_proj [experts, intermediate,
    hidden]: rank r holds gate columns [r n, (r + 1) n) and the same up columns, transposed
    into [gate rows; up rows], and those rows of down_proj, transposed."""
    from engine_utils import load_rank
    from safetensors.torch import load_file

    path = family_checkpoint(models_dir, "llama4")
    full = load_file(str(path / "model.safetensors"))
    gate_up = full["model.layers.1.feed_forward.experts.gate_up_proj"]  # [4, 64, 128]
    down = full["model.layers.1.feed_forward.experts.down_proj"]  # [4, 64, 64]
    n = 64 // tp
    for rank in range(tp):
        model, _ = load_rank(path, rank, tp)
        moe = model.model.layers[1].mlp
        cols = slice(rank * n, (rank + 1) * n)
        want = torch.cat([gate_up[:, :, cols], gate_up[:, :, 64:][:, :, cols]], -1)
        torch.testing.assert_close(moe.w13, want.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(moe.w2, down[:, cols].transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(moe.gate.weight,
                                   full["model.layers.1.feed_forward.router.weight"])


def test_mixed_steps_in_pieces_match_transformers(models_dir, monkeypatch):
    """Llama 4 in captured pieces (worker/piecewise.py, replayed on the CPU as OpGraphs):
    the temperature read from the step's positions, the unrotated layer's staging, chunked
    attention between the pieces, prompts prefilled beside decode rows. The experts take
    their capture path (every expert on every token) throughout, as inside a CUDA graph:
    on the CPU nothing else says a capture is on."""
    from test_piecewise_graphs import _pieces_on_cpu, staggered_greedy

    from tpserve.models import llama4_moe

    monkeypatch.setattr(llama4_moe, "stream_capturing", lambda device: True)
    path = family_checkpoint(models_dir, "llama4")
    engine = make_engine(path, 1, local=True, num_blocks=64)
    pieces = _pieces_on_cpu(engine, monkeypatch)
    runs, run = [0], pieces.run

    def counting_run(ids, positions, meta):
        runs[0] += 1
        return run(ids, positions, meta)

    monkeypatch.setattr(pieces, "run", counting_run)
    try:
        assert staggered_greedy(engine, PROMPTS, 12) == hf_greedy(path, PROMPTS, 12)
    finally:
        engine.shutdown()
    assert runs[0] > 0


def test_the_norm_fold_is_declined_with_a_reason(models_dir):
    from engine_utils import load_rank

    model, _ = load_rank(family_checkpoint(models_dir, "llama4"), 0, 1)
    before = model.model.layers[0].input_layernorm.weight.clone()
    assert "not Llama's" in model.fold_norms()
    torch.testing.assert_close(model.model.layers[0].input_layernorm.weight, before,
                               rtol=0, atol=0)


def test_prefix_caching_serves_chunked_layers(models_dir):
    """A cached block's keys and values do not depend on the chunk mask (each token's come
    from its own prefix), so prefix caching stays on: a request extending a 22-token prompt
    reuses its first 5 blocks of 4 (positions 0-19, across two chunk boundaries) and
    prefills from position 20, inside the chunk [16, 24); both continuations are
    transformers'."""
    from engine_utils import greedy_ids
    from tiny_models import hf_greedy_ids

    path = family_checkpoint(models_dir, "llama4")
    prefix = [(7 * i + 3) % 290 + 3 for i in range(22)]
    runs = [(prefix, 8), (prefix + [11, 12, 13], 8)]
    want = hf_greedy_ids(path, [p for p, _ in runs], [n for _, n in runs])
    engine = make_engine(path, 1, local=True, prefix_caching=True)
    hits = []
    try:
        for (prompt, n), ref in zip(runs, want, strict=True):
            before = engine.scheduler.blocks.hits
            assert greedy_ids(engine, [prompt], n) == [ref]
            hits.append(engine.scheduler.blocks.hits - before)
    finally:
        engine.shutdown()
    assert hits == [0, 5], hits


def test_two_all_reduces_per_layer(family, monkeypatch):
    """One after attention, one after the feed-forward block: an expert layer reduces its
    experts' and its shared expert's partial sums together. Counted in-process at tp = 1
    (all_reduce is called there too), the served output still transformers'."""
    from engine_utils import assert_matches_reference

    import tpserve.layers.linear as linear
    import tpserve.layers.moe as moe

    path, ref_tokens, ref_logits = family("llama4")
    engine = make_engine(path, 1, local=True)
    calls, layers = [0], [0]

    def counted(x):
        calls[0] += 1
        return x

    def count_layer(module, args):
        layers[0] += type(module).__name__ == "Llama4DecoderLayer"

    monkeypatch.setattr(linear, "all_reduce", counted)
    monkeypatch.setattr(moe, "all_reduce", counted)
    hook = torch.nn.modules.module.register_module_forward_pre_hook(count_layer)
    try:
        assert_matches_reference(engine, PROMPTS, ref_tokens, ref_logits)
    finally:
        hook.remove()
        engine.shutdown()
    assert layers[0] > 0
    assert calls[0] == 2 * layers[0], (calls[0], layers[0])
