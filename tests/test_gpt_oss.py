"""GPT-OSS beyond the tp = 1, 2, 4 family cases (tests/test_tp_families.py): attention sinks
in the torch backend against transformers' own attention, the IPEX backend declining
them (the Triton kernels' own checks: tests/kernels/), oracle guards (the reference moves when sinks, the SwiGLU clamp, the window
or the down bias are dropped or doubled), each rank's slice of the interleaved experts, a
bf16 checkpoint in several files at tp = 2, and the released MXFP4 format: packed here from
a float model, read by tpserve at tp = 2 and by transformers on its own (it dequantizes
MXFP4 on the CPU), greedy tokens and logits equal."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_utils import assert_ipex_declines_and_triton_takes, engine_matches_reference, load_rank
from tiny_models import PROMPTS, family_checkpoint, hf_reads_swiglu_config

from tpserve.kernels.base import AttentionMetadata, AttentionSpec
from tpserve.kernels.capabilities import SINKS_REASON
from tpserve.kernels.torch_backend import TorchAttentionBackend
from tpserve.layers.quant.mxfp4 import FP4_VALUES, GROUP

CPU = torch.device("cpu")


def _reference_attention(q, k, v, sinks, window, scale):
    """transformers' GPT-OSS eager attention on one sequence: q [L, H, D], k/v [L, KV, D]."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n, groups = q.shape[0], q.shape[1] // k.shape[1]
    pos = torch.arange(n)
    visible = pos[None, :] <= pos[:, None]
    if window:
        visible &= pos[None, :] > pos[:, None] - window
    mask = torch.zeros(n, n).masked_fill(~visible, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=groups, training=False)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], mask, scale)
    return out[0]  # [L, H, D]


@pytest.mark.parametrize("window", [None, 5])
def test_torch_backend_sinks_match_transformers_prefill_and_decode(window):
    """Two sequences in one mixed step (a 13-token prefill and a decode row at position 9),
    then a decode step of both, over a paged cache of 4-token blocks: each output row is
    transformers' eager GPT-OSS attention, window or not; without the sinks it is not."""
    torch.manual_seed(0)
    heads, kv, d, block = 4, 2, 16, 4
    spec = AttentionSpec(heads, kv, d, d**-0.5, sliding_window=window, block_size=block,
                         sinks=True)
    sinks = torch.randn(heads) * 2
    lens = [14, 10]  # tokens of each sequence, all cached by the end
    q = [torch.randn(n, heads, d) for n in lens]
    k = [torch.randn(n, kv, d) for n in lens]
    v = [torch.randn(n, kv, d) for n in lens]
    backend = TorchAttentionBackend()
    k_cache, v_cache = torch.zeros(16, block, kv, d), torch.zeros(16, block, kv, d)
    tables = torch.tensor([[0, 1, 2, 3], [8, 9, 10, 11]], dtype=torch.int32)
    slots = [tables[i, torch.arange(n) // block].long() * block + torch.arange(n) % block
             for i, n in enumerate(lens)]
    for i in range(2):  # the cache as it stands after this step: all but the last token
        k_cache.view(-1, kv, d)[slots[i]] = k[i]
        v_cache.view(-1, kv, d)[slots[i]] = v[i]
    want = [_reference_attention(q[i], k[i], v[i], sinks, window, spec.scale) for i in range(2)]

    def meta(q_lens, seq_lens):
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        return AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32),
                                 tables[:len(q_lens)],
                                 torch.zeros(sum(q_lens), dtype=torch.long), max(q_lens),
                                 max(seq_lens), tuple(q_lens), tuple(seq_lens))

    # Step 1: sequence 0's first 13 tokens as a chunk, sequence 1's token 9 as a decode row.
    step = torch.cat([q[0][:13], q[1][9:10]])
    got = backend.forward(step, k_cache, v_cache, meta([13, 1], [13, 10]), spec, sinks=sinks)
    torch.testing.assert_close(got[:13], want[0][:13], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[13], want[1][9], rtol=1e-5, atol=1e-5)
    # Step 2: a decode step of sequence 0 (position 13) alone.
    got = backend.forward(q[0][13:14], k_cache, v_cache, meta([1], [14]), spec, sinks=sinks)
    torch.testing.assert_close(got[0], want[0][13], rtol=1e-5, atol=1e-5)
    # Guard: the same step without sinks is plain attention, visibly different.
    plain = TorchAttentionBackend().forward(
        q[0][13:14], k_cache, v_cache, meta([1], [14]),
        AttentionSpec(heads, kv, d, d**-0.5, sliding_window=window, block_size=block))
    assert float((plain[0] - want[0][13]).abs().max()) > 0.05


def test_ipex_declines_sinks_and_triton_has_them():
    """auto passes IPEX over naming the reason, and an explicit --kernel ipex is refused with
    it (the worker selects at start-up, before serving). Triton runs sinks (its kernels are
    checked under the interpreter in tests/kernels/): here it declines for the device only,
    as it would without them."""
    from dataclasses import replace

    spec = AttentionSpec(4, 2, 16, 0.25, block_size=4, sliding_window=8, sinks=True)
    assert_ipex_declines_and_triton_takes(spec, replace(spec, sinks=False), SINKS_REASON)


@pytest.fixture(scope="module")
def gpt_oss(models_dir):
    return family_checkpoint(models_dir, "gpt-oss")


def _logits(model, tok) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(tok(p, return_tensors="pt").input_ids).logits[0, -1] for p in PROMPTS]


def _as_halves(experts) -> None:
    """What reading interleaved [gate, up] columns as [gate; up] halves would compute."""
    for t in (experts.gate_up_proj, experts.gate_up_proj_bias):
        halves = t.clone()
        t[..., 0::2], t[..., 1::2] = halves.chunk(2, dim=-1)


def test_each_gpt_oss_feature_changes_the_reference(gpt_oss):
    """Guards the oracle: transformers' logits for the prompts move when the sinks are
    dropped (-inf: plain attention) or zeroed, when the SwiGLU is not clamped, when the
    window is wider than the prompts, when the down bias counts twice (a row-parallel bias
    added by both ranks at tp = 2), when the router's bias is dropped or when gate and up are
    read as halves; so the tp cases, which match the reference, check each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gpt_oss)

    def load(**override):
        return AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.float32,
                                                    **override).eval()

    ref = _logits(load(), tok)

    def gap(model) -> float:
        return max(float((g - r).abs().max()) for g, r in zip(_logits(model, tok), ref,
                                                              strict=True))

    assert gap(load()) == 0.0
    changes = {
        "sinks dropped": lambda m: [a.self_attn.sinks.fill_(float("-inf")) for a in m.model.layers],
        "sinks zeroed": lambda m: [a.self_attn.sinks.zero_() for a in m.model.layers],
        "down bias twice": lambda m: [a.mlp.experts.down_proj_bias.mul_(2) for a in m.model.layers],
        "router bias dropped": lambda m: [a.mlp.router.bias.zero_() for a in m.model.layers],
        # A reader that took the columns as [gate; up] halves instead of interleaved.
        "gate/up as halves": lambda m: [_as_halves(a.mlp.experts) for a in m.model.layers],
    }
    for what, change in changes.items():
        model = load()
        with torch.no_grad():
            change(model)
        assert gap(model) > 0.05, what
    if hf_reads_swiglu_config():  # else transformers clamps at 7.0 whatever the config says
        assert gap(load(swiglu_limit=1e9)) > 0.05, "unclamped SwiGLU"
    assert gap(load(sliding_window=4096)) > 0.05, "no window"
    assert max(len(tok(p).input_ids) for p in PROMPTS) > 8  # longer than the window


@pytest.mark.parametrize("tp", [2, 4])
def test_gpt_oss_rank_reads_its_slice_of_the_interleaved_experts(gpt_oss, tp):
    """gate_up_proj [experts, hidden, 2 I] interleaves gate and up by column: rank r holds
    intermediate units [r n, (r + 1) n) as [gate rows; up rows] and reads exactly 1/tp of
    the tensor and of its bias; down_proj by rows of [experts, I, hidden], its bias whole;
    the sinks of its query heads."""
    from safetensors.torch import load_file

    full = load_file(str(gpt_oss / "model.safetensors"))
    pre, inter = "model.layers.1", 64
    gate_up = full[f"{pre}.mlp.experts.gate_up_proj"]
    bias = full[f"{pre}.mlp.experts.gate_up_proj_bias"]
    down = full[f"{pre}.mlp.experts.down_proj"]
    for rank in range(tp):
        model, stats = load_rank(gpt_oss, rank, tp)
        layer, n = model.model.layers[1], inter // tp
        units = torch.arange(rank * n, (rank + 1) * n)
        want = torch.cat([gate_up[:, :, 2 * units], gate_up[:, :, 2 * units + 1]], 2)
        torch.testing.assert_close(layer.mlp.w13, want.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp.b13, torch.cat([bias[:, 2 * units],
                                                             bias[:, 2 * units + 1]], 1),
                                   rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp.w2, down[:, units].transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(layer.mlp.b2, full[f"{pre}.mlp.experts.down_proj_bias"],
                                   rtol=0, atol=0)
        heads = 4 // tp
        torch.testing.assert_close(layer.self_attn.attn.sinks,
                                   full[f"{pre}.self_attn.sinks"][rank * heads:(rank + 1) * heads],
                                   rtol=0, atol=0)
        for name in ("gate_up_proj", "gate_up_proj_bias", "down_proj"):
            assert stats.fraction(f"{pre}.mlp.experts.{name}") == pytest.approx(1 / tp), name


def test_bf16_checkpoint_in_several_files_matches_transformers_at_tp2(models_dir):
    """A bf16 checkpoint split into several files with an index, as the bf16 releases
    (unsloth/gpt-oss-20b-BF16) are: served at tp = 2 in float32, it gives transformers'
    logits and greedy tokens on the same file."""
    from tiny_models import gpt_oss_config, hf_greedy, hf_last_logits, save_model

    path = save_model(gpt_oss_config(), models_dir / "gpt-oss-bf16", std=0.3, vector_std=1.0,
                      save_dtype=torch.bfloat16, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").exists()
    engine_matches_reference(path, 2, hf_greedy(path, PROMPTS, 32), hf_last_logits(path, PROMPTS))


def _quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., cols] -> (blocks [..., cols / 32, 16], scales [..., cols / 32]) uint8, as the
    released checkpoints store them: per group of 32 the power of two that brings its
    largest magnitude to at most 6 (E8M0, biased by 127), each value rounded to the nearest
    E2M1 value, two codes a byte with the first in the low nibble."""
    groups = w.float().unflatten(-1, (-1, GROUP))
    exps = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100) / 6.0))
    scaled = groups / torch.exp2(exps).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exps + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory):
    """The tiny model with its experts stored as the released checkpoints store them:
    gate_up_proj_blocks / _scales [experts, 2 I (interleaved), hidden / 32, (16)] and
    down_proj_blocks / _scales [experts, hidden, I / 32, (16)], rows the output features,
    with quantization_config mxfp4; everything else as saved."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("models") / "gpt-oss-mxfp4"
    shutil.copytree(gpt_oss, out)
    tensors = {}
    for name, t in load_file(str(gpt_oss / "model.safetensors")).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = _quantize_mxfp4(t.transpose(1, 2))  # rows: output features
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_mxfp4_test_checkpoint_is_a_real_quantization(gpt_oss, gpt_oss_mxfp4):
    """Guards the MXFP4 case: transformers' own dequantization of the packed experts is
    close to the float ones (the packing is right) but not equal (rounding to E2M1 moved
    them), so a reader that took the float checkpoint's values could not pass it."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = load_file(str(gpt_oss_mxfp4 / "model.safetensors"))
    w = load_file(str(gpt_oss / "model.safetensors"))["model.layers.0.mlp.experts.down_proj"]
    name = "model.layers.0.mlp.experts.down_proj"
    got = convert_moe_packed_tensors(packed[f"{name}_blocks"], packed[f"{name}_scales"],
                                     dtype=torch.float32)
    assert got.shape == w.shape
    rel = float((got - w).norm() / w.norm())
    assert 0.01 < rel < 0.2, rel


@pytest.mark.parametrize("tp", [2, 4])
def test_mxfp4_rank_dequantizes_its_own_slice(gpt_oss_mxfp4, tp):
    """Each rank's experts equal transformers' dequantization of the whole tensor, narrowed
    to the rank; it reads 1/tp of gate_up's blocks and of down's whole groups of 32 only
    those covering its columns (at tp = 4 a rank's 16 columns sit in one group of 32)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed = load_file(str(gpt_oss_mxfp4 / "model.safetensors"))
    pre, inter = "model.layers.2.mlp.experts", 64

    def dense(which):
        return convert_moe_packed_tensors(packed[f"{pre}.{which}_blocks"],
                                          packed[f"{pre}.{which}_scales"], dtype=torch.float32)

    gate_up, down = dense("gate_up_proj"), dense("down_proj")  # [E, H, 2I], [E, I, H]
    for rank in range(tp):
        model, stats = load_rank(gpt_oss_mxfp4, rank, tp)
        mlp, n = model.model.layers[2].mlp, inter // tp
        units = torch.arange(rank * n, (rank + 1) * n)
        want = torch.cat([gate_up[:, :, 2 * units], gate_up[:, :, 2 * units + 1]], 2)
        torch.testing.assert_close(mlp.w13, want.transpose(1, 2), rtol=0, atol=0)
        torch.testing.assert_close(mlp.w2, down[:, units].transpose(1, 2), rtol=0, atol=0)
        assert stats.fraction(f"{pre}.gate_up_proj_blocks") == pytest.approx(1 / tp)
        groups = len(range(rank * n // GROUP, -(-(rank + 1) * n // GROUP)))
        assert stats.fraction(f"{pre}.down_proj_blocks") == pytest.approx(groups / 2)


def test_mxfp4_checkpoint_matches_transformers_at_tp2(gpt_oss_mxfp4):
    """The MXFP4 checkpoint served at tp = 2 against transformers loading the same file
    (dequantized by its own MXFP4 integration, Mxfp4Config(dequantize=True)), float32:
    prefill logits within 1e-4 relative, 32 greedy tokens identical."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    tok = AutoTokenizer.from_pretrained(gpt_oss_mxfp4)
    model = AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4, dtype=torch.float32,
        quantization_config=Mxfp4Config(dequantize=True)).eval()
    ref_tokens = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                 eos_token_id=None, pad_token_id=tok.pad_token_id)
        ref_tokens.append(gen[0, ids.shape[1]:].tolist())
    assert all(len(set(t)) > 3 for t in ref_tokens)
    engine_matches_reference(gpt_oss_mxfp4, 2, ref_tokens, _logits(model, tok))


def test_mxfp4_is_refused_for_other_families():
    from types import SimpleNamespace

    from tpserve.layers.quant.config import QuantizationError, resolve_quant

    llama = SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"],
                            quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(QuantizationError, match="'mxfp4' is read only for GptOssForCausalLM"):
        resolve_quant("auto", llama)
    oss = SimpleNamespace(model_type="gpt_oss", architectures=["GptOssForCausalLM"],
                          quantization_config={"quant_method": "mxfp4"})
    assert resolve_quant("auto", oss) is None
    with pytest.raises(QuantizationError, match="--quantize fp8: this checkpoint stores its "
                                                "experts as mxfp4"):
        resolve_quant("fp8", oss)


def test_other_quantized_gpt_oss_checkpoints_are_refused_at_start():
    """Only float and MXFP4 experts load: a GPTQ gpt-oss config is refused while the ranks
    are built on the meta device, before any shard starts, naming the family and method."""
    from tiny_models import gpt_oss_config

    from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
    from tpserve.layers.quant.config import QuantizationError
    from tpserve.worker.build import check_shardable

    cfg = EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                       parallel=ParallelConfig(tp_size=2))
    hf = gpt_oss_config(quantization_config={"quant_method": "gptq", "bits": 4,
                                             "group_size": 32})
    with pytest.raises(QuantizationError, match="GptOssForCausalLM checkpoints quantized with "
                                                "gptq are not supported"):
        check_shardable(cfg, hf)
