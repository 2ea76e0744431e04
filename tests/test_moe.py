"""Mixtral's sparse experts (layers/moe.py, models/mixtral.py) beyond the end-to-end match
with transformers in test_tp_families.py: the graph-safe path (every expert on every token,
zero weights) gives the routed path's sums, and a checkpoint missing an expert is refused
with the tensor named."""

from __future__ import annotations

import pytest
import torch
from tiny_models import family_checkpoint

import tpserve.layers.moe as moe_mod
from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.distributed import tp_context
from tpserve.errors import CheckpointError
from tpserve.layers.moe import SparseMoE
from tpserve.weights import LoadStats, iter_checkpoint, load_hf_config
from tpserve.worker.build import build_model


def test_the_graph_safe_path_gives_the_routed_sums(monkeypatch):
    torch.manual_seed(0)
    with tp_context(0, 1):
        moe = SparseMoE(32, 48, num_experts=6, top_k=2, act="silu", prefix="layer")
    for p in moe.parameters():
        p.data.normal_(0.0, 0.3)
    x = torch.randn(9, 32)
    with tp_context(0, 1):
        routed = moe(x)
        monkeypatch.setattr(moe_mod, "stream_capturing", lambda device: True)
        dense = moe(x)
    assert torch.allclose(routed, dense, atol=1e-6, rtol=1e-6)
    # Two experts a token: the routing weights sum to one and pick exactly top_k experts.
    w = moe.route(x)
    assert torch.allclose(w.sum(-1), torch.ones(9)) and bool(((w > 0).sum(-1) == 2).all())


def test_a_checkpoint_missing_an_expert_is_refused_naming_it(models_dir):
    path = family_checkpoint(models_dir, "mixtral")
    cfg = EngineConfig(model=ModelConfig(path=str(path), model_id="m", max_model_len=64),
                       parallel=ParallelConfig(tp_size=1))
    gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    with tp_context(0, 1):
        model = build_model(cfg, load_hf_config(path), torch.device("cpu"))
        tensors = (w for w in iter_checkpoint(path, LoadStats(), show_progress=False)
                   if w.name != gone)
        with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
            model.load_weights(tensors)
