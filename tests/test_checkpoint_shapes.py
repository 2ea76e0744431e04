"""Checkpoints shaped unlike the fixtures of test_tp_families.py, against transformers
(float32, CPU): tensor names without the "model." prefix (a decoder saved from its base
model, as some conversions write them) and mT5 (T5 v1.1's layers under mT5's config class).
Loading checks compare each rank's parameters with the ones the prefixed file gives, which
needs no Ray; one greedy run per case checks that transformers reads the file the same way."""

from __future__ import annotations

import shutil

import pytest
import torch
from engine_utils import greedy, load_rank, make_engine
from tiny_models import PROMPTS, family_checkpoint, hf_greedy


def _strip_model_prefix(src, dst):
    """A copy of checkpoint src whose tensors are named without the leading "model."."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    assert any(n.startswith("model.") for n in tensors)
    save_file({n.removeprefix("model."): t for n, t in tensors.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("name", ["qwen3", "gemma3", "mixtral", "phi3"])
def test_names_without_the_model_prefix_load_the_same_weights(models_dir, tmp_path, name):
    """"embed_tokens.weight", "layers.0.self_attn.q_proj.weight", "norm.weight" (the head,
    when untied, stays "lm_head.weight"): each rank gets the same parameters as from the
    prefixed file, experts (Mixtral) and fused tensors (Phi-3) included."""
    path = family_checkpoint(models_dir, name)
    bare = _strip_model_prefix(path, tmp_path / f"{name}-bare")
    want, _ = load_rank(path, 1, 2)
    got, _ = load_rank(bare, 1, 2)
    for (n, a), (_, b) in zip(want.named_parameters(), got.named_parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)


def test_llama_without_the_model_prefix_matches_transformers(ray_cluster, llama_dir, tmp_path):
    """transformers loads such a file into LlamaForCausalLM as it loads the prefixed one
    (the same continuations), and tpserve at tp = 2 continues it as transformers does."""
    bare = _strip_model_prefix(llama_dir, tmp_path / "llama-bare")
    ref = hf_greedy(bare, PROMPTS, 16)
    assert ref == hf_greedy(llama_dir, PROMPTS, 16)
    engine = make_engine(bare, 2)
    try:
        assert greedy(engine, PROMPTS, 16) == ref
    finally:
        engine.shutdown()
