"""Every family's tiny checkpoint on CUDA: the in-process engine with the Triton kernels and
captured decode graphs against transformers on the CPU in float32 (greedy tokens).

The CPU suite serves each family through the torch backend and eager steps; what only a GPU
runs (graph capture, the Triton launches a family's options select) had been checked for a
few families only, and Gemma had never started there (docs/kernels-gpu-conformance.md)."""

from __future__ import annotations

import pytest
import torch
from engine_utils import assert_cuda_greedy_matches
from tiny_models import (
    FAMILY_CHECKPOINTS,
    PROMPTS,
    family_checkpoint,
    mistral_config,
    save_model,
    save_t5_model,
    t5_config,
)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# Run on CUDA by other tests already (tests/test_cuda_graphs.py, tests/test_deepseek.py).
ELSEWHERE = {"mixtral", "qwen3-moe", "qwen2-moe", "cohere-qk-norm", "cohere2", "gpt-oss",
             "llama4", "deepseek-v3"}
NAMES = sorted(set(FAMILY_CHECKPOINTS) - ELSEWHERE) + ["mistral", "t5"]


def _checkpoint(models_dir, name: str):
    if name == "mistral":
        out = models_dir / "mistral-gpu"
        return out if (out / "config.json").exists() else save_model(mistral_config(), out)
    if name == "t5":
        out = models_dir / "t5-gpu"
        return out if (out / "config.json").exists() else save_t5_model(t5_config(), out)
    return family_checkpoint(models_dir, name)


@pytest.mark.parametrize("name", NAMES)
def test_family_on_cuda_matches_transformers(models_dir, name):
    # T5's relative-bias encoder needs the torch backend, which --kernel auto picks for it;
    # that one is not graph-safe, so T5 steps eagerly.
    t5 = name == "t5"
    assert_cuda_greedy_matches(_checkpoint(models_dir, name), PROMPTS, 24,
                               kernel="auto" if t5 else "triton", graphs=not t5)
