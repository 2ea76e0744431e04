"""Checkpoint resolution and per-rank sliced reads."""

from __future__ import annotations

import pytest
import torch
from engine_utils import load_rank

from tpserve.config import EngineConfig, ModelConfig
from tpserve.distributed import tp_context
from tpserve.errors import CheckpointError, ShardingError
from tpserve.weights import LoadStats, iter_checkpoint, resolve_model


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_reads_about_one_tp_of_sharded_tensors(llama_dir, tp):
    for rank in range(tp):
        _, stats = load_rank(llama_dir, rank, tp)
        for name, full in stats.full_bytes.items():
            frac = stats.read_bytes.get(name, 0) / full
            if "norm" in name:  # replicated: read whole
                assert frac == 1.0, name
            elif "k_proj" in name or "v_proj" in name:
                # 2 KV heads: split at tp=2, each head replicated on 2 ranks at tp=4.
                assert frac == pytest.approx(1 / 2 if tp == 4 else 1 / tp), name
            elif "embed_tokens" in name or "lm_head" in name:
                # vocab 301 padded to a multiple of tp; the last rank gets fewer real rows.
                rows = -(-301 // tp)
                real = min(rows, 301 - rank * rows)
                assert frac == pytest.approx(real / 301), name
            else:
                assert frac == pytest.approx(1 / tp), name


def test_sharded_model_reassembles_the_checkpoint(llama_dir):
    """Concatenating every rank's q/k/v and o_proj slices gives back the full tensors."""
    from safetensors.torch import load_file

    full = load_file(str(llama_dir / "model.safetensors"))
    ranks = [load_rank(llama_dir, r, 2)[0] for r in range(2)]
    qkv = [m.model.layers[0].self_attn.qkv_proj for m in ranks]
    q = torch.cat([m.weight[: m.q_size] for m in qkv])
    k = torch.cat([m.weight[m.q_size : m.q_size + m.kv_size] for m in qkv])
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(k, full["model.layers.0.self_attn.k_proj.weight"])
    o = torch.cat([m.model.layers[0].self_attn.o_proj.weight for m in ranks], dim=1)
    assert torch.equal(o, full["model.layers.0.self_attn.o_proj.weight"])


def test_heads_not_divisible_fail_at_load_naming_the_tensor(models_dir, ray_cluster):
    from engine_utils import make_engine
    from tiny_models import llama_config, save_model

    path = save_model(llama_config(num_attention_heads=6, num_key_value_heads=6,
                                   hidden_size=48), models_dir / "llama6")
    with pytest.raises(Exception) as info:
        make_engine(path, 4)
    msg = str(info.value)
    assert "model.layers.0.self_attn.q_proj.weight" in msg
    assert "tp=4" in msg and "6" in msg and "not divisible" in msg


def test_resolve_model_reports_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError) as info:
        resolve_model("acme/does-not-exist")
    msg = str(info.value)
    assert "acme/does-not-exist" in msg and "local directory" in msg and "cache" in msg
    with pytest.raises(CheckpointError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_model_finds_hub_cache_snapshot(tmp_path, monkeypatch, llama_dir):
    """A hub id already in the local cache resolves offline to its snapshot."""
    import shutil

    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / ("a" * 40)
    shutil.copytree(llama_dir, snap)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model("acme/tiny") == snap


def test_sharded_index_files_are_read(tmp_path, llama_dir):
    """A checkpoint split over several files with an index.json loads the same tensors."""
    import json

    from safetensors.torch import load_file, save_file

    full = load_file(str(llama_dir / "model.safetensors"))
    names = sorted(full)
    half = len(names) // 2
    out = tmp_path / "sharded"
    out.mkdir()
    for f in llama_dir.iterdir():
        if f.suffix == ".json" and f.name != "model.safetensors.index.json":
            (out / f.name).write_text(f.read_text())
    save_file({n: full[n] for n in names[:half]}, str(out / "model-00001-of-00002.safetensors"))
    save_file({n: full[n] for n in names[half:]}, str(out / "model-00002-of-00002.safetensors"))
    weight_map = {n: f"model-0000{1 if i < half else 2}-of-00002.safetensors"
                  for i, n in enumerate(names)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    stats = LoadStats()
    seen = {t.name for t in iter_checkpoint(out, stats, show_progress=False)}
    assert seen == set(names)


def test_missing_weights_are_an_error(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    full = load_file(str(llama_dir / "model.safetensors"))
    del full["model.layers.1.mlp.down_proj.weight"]
    for f in llama_dir.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_text(f.read_text())
    save_file(full, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        load_rank(tmp_path, 0, 1)


def test_no_safetensors_is_a_clear_error(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="pytorch_model.bin"):
        list(iter_checkpoint(tmp_path, LoadStats()))


def test_sharding_error_type_is_raised_on_meta(llama_dir):
    from tiny_models import llama_config

    from tpserve.worker.build import build_model

    cfg = EngineConfig(model=ModelConfig(path=str(llama_dir), model_id="t", max_model_len=64))
    with tp_context(0, 3), pytest.raises(ShardingError, match="tp=3"):
        build_model(cfg, llama_config(), torch.device("meta"))


def test_dummy_load_format_needs_no_weights(tmp_path, llama_dir):
    """--load-format dummy: the checkpoint's shapes with random weights, no safetensors read."""
    import shutil

    from tpserve.config import CacheConfig
    from tpserve.engine.engine import Engine
    from tpserve.engine.request import SamplingParams
    from tpserve.executor.inprocess import InProcessExecutor

    for f in llama_dir.iterdir():
        if f.suffix == ".json":
            shutil.copy(f, tmp_path / f.name)
    cfg = EngineConfig(model=ModelConfig(path=str(tmp_path), model_id="t", max_model_len=64,
                                         load_format="dummy"),
                       cache=CacheConfig(num_blocks=32, block_size=4))
    engine = Engine(cfg, InProcessExecutor(cfg))
    ev = engine.generate(["Hello"], SamplingParams(max_new_tokens=5, ignore_eos=True))[0]
    assert ev.generated_tokens == 5
    assert engine.load_reports[0].read_bytes == {}


def test_checkpoint_tensor_of_wrong_shape_fails_naming_it(tmp_path, llama_dir):
    from safetensors.torch import load_file, save_file

    full = load_file(str(llama_dir / "model.safetensors"))
    w = full["model.layers.0.mlp.up_proj.weight"]
    full["model.layers.0.mlp.up_proj.weight"] = torch.cat([w, w[:4]])  # 4 rows too many
    for f in llama_dir.iterdir():
        if f.suffix == ".json":
            (tmp_path / f.name).write_text(f.read_text())
    save_file(full, str(tmp_path / "model.safetensors"))
    with pytest.raises(ShardingError, match=r"up_proj.weight' has shape \[132, 64\]"):
        load_rank(tmp_path, 0, 2)
