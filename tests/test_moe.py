"""The sparse experts (layers/moe.py, models/experts.py) of Mixtral, Qwen2-MoE and Qwen3-MoE
beyond the end-to-end match with transformers in test_tp_families.py: the graph-safe path
(every expert on every token, zero weights) gives the routed path's sums, with and without
renormalised weights and with Qwen2-MoE's shared expert; experts stored fused (as
transformers 5 writes them with save_original_format=False) load the same rank slices as
experts stored one by one, each rank reading only its share; a checkpoint missing an expert,
or with experts on a layer the config makes dense, is refused with the tensor named; an
uneven shared expert is refused at start (quantized experts: tests/test_quant_moe.py)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from engine_utils import load_rank
from tiny_models import family_checkpoint

import tpserve.layers.moe as moe_mod
from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.distributed import tp_context
from tpserve.errors import CheckpointError
from tpserve.layers.moe import SparseMoE
from tpserve.weights import LoadStats, iter_checkpoint, load_hf_config
from tpserve.worker.build import build_model


def _block(kind: str) -> SparseMoE:
    """A random block: Mixtral's (renormalised), Qwen3-MoE's without renormalising, or
    Qwen2-MoE's with its shared expert."""
    from tiny_models import qwen2_moe_config

    from tpserve.models.qwen2_moe import SharedExpertMoE

    torch.manual_seed(0)
    with tp_context(0, 1):
        if kind == "shared":
            cfg = qwen2_moe_config(hidden_size=32, moe_intermediate_size=48, num_experts=6)
            moe = SharedExpertMoE(cfg, "layer")
        else:
            moe = SparseMoE(32, 48, num_experts=6, top_k=2, act="silu", prefix="layer",
                            renormalize=kind == "renormalised")
    for p in moe.parameters():
        p.data.normal_(0.0, 0.3)
    return moe


@pytest.mark.parametrize("kind", ["renormalised", "raw", "shared"])
def test_the_graph_safe_path_gives_the_routed_sums(monkeypatch, kind):
    moe = _block(kind)
    x = torch.randn(9, 32)
    with tp_context(0, 1):
        routed = moe(x)
        monkeypatch.setattr(moe_mod, "stream_capturing", lambda device: True)
        dense = moe(x)
    torch.testing.assert_close(dense, routed, atol=1e-5, rtol=1e-5)
    # Two experts a token, exactly; their weights sum to one only when renormalised.
    w = moe.route(x)
    assert bool(((w > 0).sum(-1) == 2).all())
    probs = torch.softmax(x @ moe.gate.weight.t(), -1)
    want = torch.ones(9) if kind == "renormalised" else probs.topk(2, -1).values.sum(-1)
    torch.testing.assert_close(w.sum(-1), want)


def _built(path, tp: int = 1, rank: int = 0, hf=None):
    cfg = EngineConfig(model=ModelConfig(path=str(path), model_id="m", max_model_len=64),
                       parallel=ParallelConfig(tp_size=tp))
    with tp_context(rank, tp):
        return build_model(cfg, hf or load_hf_config(path), torch.device("cpu"))


def _tensors(path):
    return iter_checkpoint(path, LoadStats(), show_progress=False)


@pytest.mark.parametrize(("name", "gone"), [
    ("mixtral", "model.layers.1.block_sparse_moe.experts.3.w2.weight"),
    ("qwen3-moe", "model.layers.2.mlp.experts.7.down_proj.weight"),
    ("qwen2-moe", "model.layers.3.mlp.experts.5.up_proj.weight"),
    ("granite-moe", "model.layers.1.block_sparse_moe.output_linear.weight"),
])
def test_a_checkpoint_missing_an_expert_is_refused_naming_it(models_dir, name, gone):
    path = family_checkpoint(models_dir, name)
    model = _built(path)
    with tp_context(0, 1), pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        model.load_weights(w for w in _tensors(path) if w.name != gone)


def test_experts_on_a_dense_layer_are_refused(models_dir):
    """Layer 1 of the Qwen3-MoE checkpoint is dense (mlp_only_layers): a checkpoint with
    experts there was made for another config."""
    path = family_checkpoint(models_dir, "qwen3-moe")
    model = _built(path)
    stray = SimpleNamespace(name="model.layers.1.mlp.experts.0.gate_proj.weight",
                            shape=(32, 64))
    with tp_context(0, 1), pytest.raises(CheckpointError, match="layer 1, which the config "
                                         "makes dense"):
        model.load_weights(itertools.chain(_tensors(path), [stray]))


def _save_fused(src, dst):
    """transformers' own file of the same weights with the experts fused per layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.save_pretrained(dst, save_original_format=False)
    return dst


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe", "qwen2-moe"])
def test_fused_experts_load_the_same_slices(models_dir, tmp_path, name):
    from safetensors import safe_open

    path = family_checkpoint(models_dir, name)
    fused = _save_fused(path, tmp_path / name)
    with safe_open(str(fused / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    stacked = sorted(n for n in names if n.endswith(("experts.gate_up_proj",
                                                     "experts.down_proj")))
    assert stacked and not any(".experts.0." in n for n in names)  # really the fused layout
    for rank in range(2):
        want, _ = load_rank(path, rank, 2)
        got, stats = load_rank(fused, rank, 2)
        for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(),
                                  strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
        for n in stacked:
            assert stats.fraction(n) == pytest.approx(1 / 2), n


@pytest.mark.parametrize("tp", [2, 4])
def test_granite_moe_rank_reads_its_rows_of_input_linear(models_dir, tmp_path, tp):
    """GraniteMoE's files hold the experts fused only: input_linear [experts, (gate; up),
    hidden] gives each rank its gate rows then its up rows, output_linear its columns, each
    1/tp read, the router (router.layer) whole; transformers 5's own layout of the same
    weights (experts.gate_up_proj, experts.down_proj, router.weight) loads the same."""
    from safetensors.torch import load_file

    path = family_checkpoint(models_dir, "granite-moe")
    full = load_file(str(path / "model.safetensors"))
    pre, inter = "model.layers.1.block_sparse_moe", 64
    w_in, w_out = full[f"{pre}.input_linear.weight"], full[f"{pre}.output_linear.weight"]
    renamed = _save_fused(path, tmp_path / "granite-moe")
    assert f"{pre}.experts.gate_up_proj" in load_file(str(renamed / "model.safetensors"))
    for rank in range(tp):
        model, stats = load_rank(path, rank, tp)
        moe, n = model.model.layers[1].mlp, inter // tp
        rows = slice(rank * n, (rank + 1) * n)
        want = torch.cat([w_in[:, rows], w_in[:, inter:][:, rows]], dim=1)
        torch.testing.assert_close(moe.w13, want, rtol=0, atol=0)
        torch.testing.assert_close(moe.w2, w_out[:, :, rows], rtol=0, atol=0)
        torch.testing.assert_close(moe.gate.weight, full[f"{pre}.router.layer.weight"],
                                   rtol=0, atol=0)
        for name in ("input_linear.weight", "output_linear.weight"):
            assert stats.fraction(f"{pre}.{name}") == pytest.approx(1 / tp), name
        got, _ = load_rank(renamed, rank, tp)
        for (name, a), (_, b) in zip(model.named_parameters(), got.named_parameters(),
                                     strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_rank_reads_its_share_of_each_expert(models_dir, tp):
    """Per-expert files: gate and up by rows, down by columns, 1/tp of each; the router and
    the shared expert's gate whole."""
    path = family_checkpoint(models_dir, "qwen2-moe")
    _, stats = load_rank(path, tp - 1, tp)
    for n in stats.full_bytes:
        if ".experts." in n or ".shared_expert." in n:
            assert stats.fraction(n) == pytest.approx(1 / tp), n
        elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
            assert stats.fraction(n) == 1, n


def test_an_uneven_shared_expert_is_refused_at_start():
    from tiny_models import qwen2_moe_config

    from tpserve.errors import ShardingError
    from tpserve.worker.build import check_shardable

    cfg = EngineConfig(model=ModelConfig(path="unused", model_id="m", max_model_len=64),
                       parallel=ParallelConfig(tp_size=4))
    with pytest.raises(ShardingError) as err:
        check_shardable(cfg, qwen2_moe_config(shared_expert_intermediate_size=66))
    for needle in ("'model.layers.1.mlp.shared_expert.gate_proj.weight'", "[66, 64]", "tp=4",
                   "intermediate size = 66 is not divisible by 4"):
        assert needle in str(err.value)
