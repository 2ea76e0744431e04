"""Random PEFT LoRA adapters shaped for a model directory's config.json, written without peft
or the base weights (a Llama-3-8B shape with dummy weights has no checkpoint to load), for
timing steps that hold adapter rows (engine_step.py --lora). Values are small and random:
the outputs mean nothing, only the shapes and the work do."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection of a Llama-shaped decoder layer."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg.get("num_key_value_heads", heads) * head_dim
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
            "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}


def random_adapters(model_dir: Path, n: int, rank: int, out: Path) -> list[tuple[str, str]]:
    """n adapters of rank `rank` on every target of every layer; (name, path) pairs as
    --lora-modules takes them."""
    if n == 0:  # nothing to shape: the model need not be Llama-shaped
        return []
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = _shapes(cfg)
    pairs = []
    for i in range(n):
        gen = torch.Generator().manual_seed(i)
        tensors = {}
        for layer in range(cfg["num_hidden_layers"]):
            for name in TARGETS:
                n_in, n_out = shapes[name]
                mod = "self_attn" if name in TARGETS[:4] else "mlp"
                key = f"base_model.model.model.layers.{layer}.{mod}.{name}.lora_"
                tensors[key + "A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.01
                tensors[key + "B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.01
        path = out / f"adapter{i}"
        path.mkdir(parents=True, exist_ok=True)
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
                  str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
             "target_modules": list(TARGETS), "bias": "none"}))
        pairs.append((f"adapter{i}", str(path)))
    return pairs
