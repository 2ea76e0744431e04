"""Loads every --lora-modules adapter into a shard's linear layers, each rank reading only
its slice: a column-parallel layer keeps A whole and takes its rows of B (per fused
projection, as the base weight's rows); a row-parallel layer takes its columns of A and
keeps B whole, so the delta joins the rank's partial sum before the all-reduce it already
does. Adapter i goes to slot i of each layer's LoraWeights (layers/lora.py)."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tpserve.config import LoraConfig
from tpserve.distributed import get_tp
from tpserve.layers.interleaved_rotary import half_order
from tpserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tpserve.layers.lora import LoraWeights
from tpserve.lora_config import WEIGHTS_FILE, AdapterSpec, LoraError, read_adapters
from tpserve.models.llama import head_dim_of

# Projections of Llama-shaped decoder layers, the ones checked against transformers + peft.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_LINEAR = (QKVParallelLinear, MergedColumnParallelLinear, ColumnParallelLinear,
           RowParallelLinear)


def _targets(model: nn.Module) -> dict[str, tuple[nn.Module, int]]:
    """Checkpoint module name -> (the layer holding it, its projection index there)."""
    out: dict[str, tuple[nn.Module, int]] = {}
    for layer in model.modules():
        if type(layer) not in _LINEAR:  # subclasses may lay rows out otherwise
            continue
        modules = [layer.prefix] if isinstance(layer, RowParallelLinear) \
            else layer.checkpoint_modules()
        for j, name in enumerate(modules):
            if name.rsplit(".", 1)[-1] in TARGETS:
                out[name] = (layer, j)
    return out


def _out_total(layer: nn.Module, part: int) -> int:
    """Output features of checkpoint module `part` of layer, over all ranks."""
    if isinstance(layer, QKVParallelLinear):
        d = layer.head_dim
        sizes = [layer.total_heads * d, layer.total_kv_heads * d, layer.total_kv_heads * d]
    elif isinstance(layer, MergedColumnParallelLinear):
        sizes = layer.out_sizes
    else:
        sizes = [layer.out_features]
    return sizes[part] if len(layer.checkpoint_modules()) == len(sizes) else sum(sizes)


def _pairs(spec: AdapterSpec, keys: list[str], targets: dict) -> dict[str, dict[str, str]]:
    """module -> {"A": key, "B": key}; refuses a tensor of a module LoRA cannot target here."""
    pairs: dict[str, dict[str, str]] = {}
    for key in keys:
        m = _KEY.match(key)
        if m is None:
            continue
        if m["module"] not in targets:
            raise LoraError(
                f"LoRA adapter {spec.name!r}: tensor {key!r} targets module {m['module']!r}, "
                f"which is not a linear layer tpserve applies LoRA to in this model; target "
                f"modules must be among {', '.join(TARGETS)} of its decoder layers")
        pairs.setdefault(m["module"], {})[m["ab"]] = key
    other = [key for key in keys if _KEY.match(key) is None]
    if other:
        raise LoraError(f"LoRA adapter {spec.name!r}: tensor {other[0]!r} is not a LoRA A or B "
                        "matrix (an embedding LoRA or a saved base-model weight); tpserve "
                        "serves lora_A/lora_B pairs of linear layers only")
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {spec.name!r}: module {module!r} has lora_"
                            f"{''.join(ab)} but not lora_{'B' if 'A' in ab else 'A'}")
    return pairs


def _check_shape(spec: AdapterSpec, key: str, got: list[int], want: list[int]) -> None:
    if list(got) != want:
        raise LoraError(f"LoRA adapter {spec.name!r}: tensor {key!r} has shape {list(got)} but "
                        f"the base model implies {want}: the adapter was trained on another "
                        "model")


def _ensure(layer: nn.Module, slots: int, width: int, dtype: torch.dtype,
            device: torch.device) -> LoraWeights:
    if layer.lora is None:
        if isinstance(layer, RowParallelLinear):
            parts, n_in, n_out = 1, layer.in_per_rank, layer.out_features
        else:
            parts = len(layer.checkpoint_modules())
            n_in, n_out = layer.in_features, layer.out_per_rank
        layer.lora = LoraWeights(slots, parts, width, n_in, n_out, dtype, device)
    return layer.lora


def _row_order(model: nn.Module):
    """module name, B rows -> B rows in the order the base weight's rows are held: each
    head's rotate-half order for the projections a model reorders at load (Cohere's
    interleaved rotary, layers/interleaved_rotary.py), else as stored."""
    reordered = getattr(model, "half_order_modules", ())
    head_dim = head_dim_of(model.config) if reordered else 0

    def order(module: str, rows: torch.Tensor) -> torch.Tensor:
        if module.rsplit(".", 1)[-1] not in reordered:
            return rows
        by_head = rows.view(-1, head_dim, rows.shape[-1])
        return by_head[:, half_order(head_dim)].reshape(rows.shape)
    return order


def _load_one(slot: int, spec: AdapterSpec, width: int, targets: dict, dtype, device,
              slots: int, order) -> None:
    tp = get_tp()
    with safe_open(str(Path(spec.path) / WEIGHTS_FILE), framework="pt") as f:
        pairs = _pairs(spec, list(f.keys()), targets)
        for module, ab in pairs.items():
            layer, part = targets[module]
            a, b = f.get_slice(ab["A"]), f.get_slice(ab["B"])
            row = isinstance(layer, RowParallelLinear)
            out_total = layer.out_features if row else _out_total(layer, part)
            _check_shape(spec, ab["A"], a.get_shape(), [spec.rank, layer.in_features])
            _check_shape(spec, ab["B"], b.get_shape(), [out_total, spec.rank])
            weights = _ensure(layer, slots, width, dtype, device)
            if row:
                n = layer.in_per_rank
                regions = [(a[:, tp.rank * n : (tp.rank + 1) * n], b[:, :], 0)]
            else:
                a_whole = a[:, :]
                regions = [(a_whole, order(module, b[src : src + n, :]), dst)
                           for src, n, dst in layer.lora_regions()[part]]
            for a_part, b_rows, at in regions:
                weights.set(slot, part, a_part.to(device, dtype),
                            (b_rows.float() * spec.scale).to(device, dtype), at)


def attach_adapters(model: nn.Module, cfg: LoraConfig, dtype: torch.dtype,
                    device: torch.device) -> list[AdapterSpec]:
    """Read and check every adapter (LoraError naming the tensor or option), load this
    rank's slices; returns the specs in slot order."""
    specs = read_adapters(cfg.adapters, cfg.max_rank)
    targets = _targets(model)
    width = max(spec.rank for spec in specs)  # smaller ranks are zero padded to it
    order = _row_order(model)
    for slot, spec in enumerate(specs):
        _load_one(slot, spec, width, targets, dtype, device, len(specs), order)
    return specs
