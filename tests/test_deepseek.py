"""DeepSeek-V2 / V3 beyond the family cases of tests/test_tp_families.py: an fp8
block-scaled V3 checkpoint at tp = 2 against transformers on its dequantized weights, the
router's correction bias and YaRN's mscale as oracle guards, the multi-token-prediction
layer skipped at load, options tpserve refuses at start, the attention spec of the real
head sizes (192-wide keys) refused by the Triton backend so the torch backend runs it,
DeepSeek-V3's published config at tp = 8 on the meta device, and the decode graphs' static
buffers (replayed on the CPU; the CUDA capture case waits for a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from engine_utils import cuda_engine, engine_matches_reference, greedy, load_rank, make_engine
from quant_checkpoints import write_fp8_block_misread, write_quantized
from safetensors.torch import load_file, save_file
from tiny_models import (
    FAMILY_CHECKPOINTS,
    PROMPTS,
    deepseek_v2_config,
    deepseek_v3_config,
    family_checkpoint,
    hf_greedy,
    hf_last_logits,
)

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.distributed import tp_context
from tpserve.kernels.torch_backend import TorchAttentionBackend
from tpserve.layers.mla import mla_softmax_scale
from tpserve.worker.build import check_shardable

_fp8: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def fp8_v3(models_dir):
    """(quantized dir, dequantized reference dir, reference tokens, reference logits):
    blocks of 32 x 32, so tp = 2 cuts q_b_proj (48 rows a rank), the experts (16) and
    kv_a_proj_with_mqa's 40 rows inside blocks."""
    if not _fp8:
        src = family_checkpoint(models_dir, "deepseek-v3")
        q, ref = write_quantized(src, models_dir / "deepseek-v3-fp8", models_dir /
                                 "deepseek-v3-fp8-ref", "fp8", fp8_block=(32, 32))
        _fp8["v"] = (q, ref, hf_greedy(ref, PROMPTS, 32), hf_last_logits(ref, PROMPTS))
    yield _fp8["v"]
    _fp8.clear()


def test_fp8_block_scaled_v3_matches_transformers_at_tp2(fp8_v3):
    qdir, _, tokens, logits = fp8_v3
    names = load_file(str(qdir / "model.safetensors"))
    # The checkpoint is what the releases hold: every MLA and expert linear in e4m3 with
    # block scales, the router float.
    for part in ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj",
                 "mlp.experts.3.down_proj", "mlp.shared_experts.gate_proj"):
        assert names[f"model.layers.1.{part}.weight"].dtype == torch.float8_e4m3fn, part
        assert f"model.layers.1.{part}.weight_scale_inv" in names, part
    assert names["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    engine_matches_reference(qdir, 2, tokens, logits)


def test_fp8_oracle_tells_block_scales_apart(fp8_v3, tmp_path):
    """A reader taking one scale per row would be far outside the tolerance."""
    qdir, _, _, logits = fp8_v3
    wrong = write_fp8_block_misread(qdir, tmp_path / "row", "row")
    got = hf_last_logits(wrong, PROMPTS)
    assert max(float((g - r).abs().max()) for g, r in zip(got, logits, strict=True)) > 0.05


def _hf_logits(model, path) -> list[torch.Tensor]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return [model(tok(p, return_tensors="pt").input_ids).logits[0, -1] for p in PROMPTS]


def test_the_correction_bias_changes_the_reference(models_dir):
    """Guards the oracle: V3's e_score_correction_bias (random in the tiny checkpoint) picks
    other experts; transformers' logits without it differ, so matching them checks it."""
    from transformers import AutoModelForCausalLM

    path = family_checkpoint(models_dir, "deepseek-v3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = _hf_logits(model, path)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            assert layer.mlp.gate.e_score_correction_bias.abs().max() > 0.05
            layer.mlp.gate.e_score_correction_bias.zero_()
    got = _hf_logits(model, path)
    assert max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True)) > 0.05


def test_the_softmax_scale_is_transformers_with_mscale():
    """mscale_all_dim squared on the scores (factor 4: 1.1386^2), as transformers' own
    attention computes it; a plain 1 / sqrt(24) would be 30% off, and the logits follow
    (the rope_parameters guard in tests/test_tp_families.py changes YaRN as a whole)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = deepseek_v3_config()
    want = DeepseekV3Attention(cfg, 0).scaling
    assert mla_softmax_scale(cfg) == pytest.approx(want, rel=1e-12)
    assert abs(want - 24 ** -0.5) > 0.2 * 24 ** -0.5
    plain = deepseek_v2_config()
    assert mla_softmax_scale(plain) == pytest.approx(24 ** -0.5, rel=1e-12)


def test_v3_without_mscale_changes_the_reference(models_dir):
    from transformers import AutoModelForCausalLM

    path = family_checkpoint(models_dir, "deepseek-v3")
    ref = hf_last_logits(path, PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer in model.model.layers:
        layer.self_attn.scaling = 24 ** -0.5
    got = _hf_logits(model, path)
    assert max(float((g - r).abs().max()) for g, r in zip(got, ref, strict=True)) > 0.05


def test_the_multi_token_prediction_layer_is_not_read(models_dir, tmp_path):
    """A V3 checkpoint's layer num_hidden_layers (MTP: eh_proj, enorm, hnorm and a whole
    decoder layer) is skipped; the model loads exactly the other tensors."""
    src = family_checkpoint(models_dir, "deepseek-v3")
    out = tmp_path / "mtp"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(src / "model.safetensors"))
    extra = {k.replace("layers.2.", "layers.3."): v.clone() for k, v in weights.items()
             if ".layers.2." in k}
    extra["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    extra["model.layers.3.enorm.weight"] = torch.ones(64)
    save_file({**weights, **extra}, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    model, stats = load_rank(out, 0, 1)
    plain, _ = load_rank(src, 0, 1)
    assert len(model.model.layers) == 3
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters(),
                                 strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert stats.fraction("model.layers.3.eh_proj.weight") == 0


REFUSED = [
    ("deepseek-v2", {"moe_layer_freq": 2}, ["moe_layer_freq = 2", "first_k_dense_replace"]),
    ("deepseek-v2", {"norm_topk_prob": True}, ["norm_topk_prob = True", "does not renormalise"]),
    ("deepseek-v2", {"topk_method": "noaux_tc"}, ["topk_method = 'noaux_tc'", "'greedy'"]),
    ("deepseek-v3", {"scoring_func": "softmax"}, ["scoring_func = 'softmax'", "sigmoid"]),
    ("deepseek-v3", {"topk_method": "greedy"}, ["topk_method = 'greedy'", "noaux_tc"]),
]


@pytest.mark.parametrize(("name", "overrides", "needles"), REFUSED,
                         ids=[f"{r[0]}-{next(iter(r[1]))}" for r in REFUSED])
def test_options_transformers_does_not_run_are_refused_at_start(name, overrides, needles):
    cfg = EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                       parallel=ParallelConfig(tp_size=1))
    hf = FAMILY_CHECKPOINTS[name][0]()
    for k, v in overrides.items():
        setattr(hf, k, v)
    with pytest.raises(ValueError) as err:
        check_shardable(cfg, hf)
    for needle in needles:
        assert needle in str(err.value)


def test_the_real_head_sizes_run_on_either_backend():
    """V3's keys are 128 + 64 = 192 wide (values padded to them): not a power of two, which
    the Triton kernels pad to 256 inside their tiles, so Triton declines the spec for the
    device only (here: the CPU), as it would a power of two."""
    from dataclasses import replace

    from tpserve.kernels.triton_backend import TritonAttentionBackend
    from tpserve.models.deepseek import DeepseekV3ForCausalLM

    hf = deepseek_v3_config(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                            num_attention_heads=8)
    with tp_context(0, 2), torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf, max_positions=64)
    spec = model.model.layers[0].self_attn.attn.spec
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (4, 4, 192)
    cpu = torch.device("cpu")
    assert (TritonAttentionBackend.supports(cpu, torch.float32, spec)
            == TritonAttentionBackend.supports(cpu, torch.float32, replace(spec, head_dim=128)))
    assert TorchAttentionBackend.supports(cpu, torch.float32, spec) is None


def _real_v3(**drop):
    from pathlib import Path

    from transformers import CONFIG_MAPPING

    d = json.loads((Path(__file__).parent / "data" / "configs" / "DeepSeek-V3.json").read_text())
    for k in drop:
        d.pop(k)
    return CONFIG_MAPPING[d["model_type"]].from_dict(d)


# Held whole by every rank: the norms (q_a_layernorm, kv_a_layernorm among them), the routers
# and the two latent projections every head reads.
_REPLICATED = ("norm", "mlp.gate.weight", "q_a_proj", "kv_a_proj_with_mqa")


def test_real_v3_shapes_add_up_per_rank_at_tp8():
    """DeepSeek-V3's published config (tests/data/configs/DeepSeek-V3.json, float weights)
    on the meta device: 8 ranks' parameters sum to transformers' own count plus the
    replicated ones 7 more times and each rank's copy of the 58 routers' correction biases
    (a buffer in transformers); every rank holds 16 heads of 192-wide keys."""
    from transformers import AutoModelForCausalLM

    from tpserve.worker.build import build_model

    hf = _real_v3(quantization_config=None)
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(hf)
    full = sum(p.numel() for p in ref.parameters())
    replicated = sum(p.numel() for n, p in ref.named_parameters()
                     if any(r in n for r in _REPLICATED))
    assert 670e9 < full < 672e9  # the main model's 671B (the MTP layer is not built)
    cfg = EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                       parallel=ParallelConfig(tp_size=8))
    counts = []
    for rank in range(8):
        with tp_context(rank, 8):
            model = build_model(cfg, hf, torch.device("meta"))
        counts.append(sum(p.numel() for p in model.parameters()))
        spec = model.model.layers[0].self_attn.attn.spec
        assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (16, 16, 192)
    assert len(model.model.layers) == 61
    assert len(set(counts)) == 1
    assert sum(counts) == full + 7 * replicated + 8 * 58 * 256


def test_real_v3_fp8_checkpoint_shards_at_tp8():
    """The published fp8 layout (128 x 128 blocks) builds at tp = 8 with whole blocks on a
    rank: kv_b_proj's 16 heads x 256 rows, q_b_proj's 16 x 192, an expert's 256 of 2048
    (one rank: every rank's build takes minutes on two cores)."""
    from tpserve.worker.build import build_model

    cfg = EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                       parallel=ParallelConfig(tp_size=8))
    with tp_context(3, 8):
        model = build_model(cfg, _real_v3(), torch.device("meta"))
    attn, moe = model.model.layers[3].self_attn, model.model.layers[3].mlp
    for layer in (attn.q_b_proj, attn.kv_b_proj, attn.o_proj, attn.q_a_proj,
                  moe.experts[0].gate_up_proj, moe.experts[255].down_proj,
                  moe.shared_experts.down_proj):
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.method.block == (128, 128), layer.prefix
    assert tuple(attn.kv_b_proj.weight_scale_inv.shape) == (32, 4)
    assert model.model.layers[3].mlp.gate.weight.dtype == torch.float32


@pytest.mark.parametrize("name", ["deepseek-v2", "deepseek-v3"])
def test_static_buffer_decode_path_serves_deepseek(models_dir, name):
    """MLA's padded heads and the routed and shared experts through the decode graphs'
    static buffers (each bucket replayed eagerly on the CPU): transformers' tokens."""
    from test_cuda_graphs import EagerReplay

    from tpserve.worker.graphs import DecodeGraphs

    path = family_checkpoint(models_dir, name)
    engine = make_engine(path, 1, local=True, num_blocks=64)
    worker = engine.executor.worker
    graphs = DecodeGraphs(worker.model, worker.kv_caches, worker.backend, worker.device,
                          (1, 2, 8), max_blocks=64, block_size=4,
                          scratch_block=worker.num_blocks)
    for b in graphs.buckets:
        out = graphs._forward(b)
        graphs.graphs[b] = (EagerReplay(graphs, b, out), out)
    worker.graphs = worker.runner.graphs = graphs
    try:
        assert greedy(engine, PROMPTS, 24) == hf_greedy(path, PROMPTS, 24)
    finally:
        engine.shutdown()
    assert graphs.graphs[8][0].replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_captured_graphs_serve_deepseek_v3_on_cuda(models_dir):
    """With a head size the Triton kernels take (nope 24 + rope 8 = 32), the Triton backend
    and captured decode graphs run MLA and the experts (every expert on every token inside
    the graph). Not run yet: no GPU in the session that wrote it."""
    from tiny_models import save_model

    path = models_dir / "deepseek-v3-head32"
    if not (path / "config.json").exists():
        save_model(deepseek_v3_config(qk_nope_head_dim=24), path, std=0.3, vector_std=0.1,
                   buffer_std=0.1)
    engine = cuda_engine(path, True)
    try:
        assert engine.executor.health()[0]["decode_graphs"]
        assert greedy(engine, PROMPTS, 32) == hf_greedy(path, PROMPTS, 32)
    finally:
        engine.shutdown()


def test_v3_rotating_halves_matches_transformers(models_dir):
    """rope_interleave false (V3's other layout): the rope dimensions rotate in halves, as
    transformers then computes; the interleaved guard in tests/test_tp_families.py shows the
    two layouts give other logits."""
    from tiny_models import save_model

    path = models_dir / "deepseek-v3-halves"
    if not (path / "config.json").exists():
        save_model(deepseek_v3_config(rope_interleave=False), path, std=0.3, vector_std=0.1,
                   buffer_std=0.1)
    engine = make_engine(path, 1, local=True, num_blocks=64)
    try:
        assert greedy(engine, PROMPTS, 24) == hf_greedy(path, PROMPTS, 24)
    finally:
        engine.shutdown()
