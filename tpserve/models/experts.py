"""Loading checkpoints of mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE,
GraniteMoE, whose files hold only the fused layout, as input_linear / output_linear): which
layers are sparse, and the expert tensors taken out of the stream into each layer's SparseMoE
in either layout a checkpoint may have:

- per expert, as the hub's checkpoints and transformers' save_pretrained write them:
  layers.{i}.{block}.experts.{e}.{gate|up|down name}.weight;
- fused, as transformers 5 holds them in memory and writes them with
  save_original_format=False (or for an offloaded model): layers.{i}.mlp.experts.gate_up_proj
  [experts, 2 * intermediate, hidden] and layers.{i}.mlp.experts.down_proj
  [experts, hidden, intermediate].

The experts of a quantized checkpoint (SparseMoE.experts: one QuantizedExpert each) are read
per expert only: their tensors (qweight, scales, weight_scale_inv, weight_packed ...) go on
to loader.load_into under the expert's name, which maps them onto its layers (the family's
stacked names fuse gate and up). A router stored quantized is refused naming its tensor.

Every other tensor goes on to loader.load_into."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from torch import nn

from tpserve.errors import CheckpointError
from tpserve.layers.moe import PARTS, SparseMoE
from tpserve.weights import TensorSlice


def is_sparse_layer(config, i: int) -> bool:
    """transformers' rule for Qwen2-MoE / Qwen3-MoE: a layer is sparse unless it is in
    mlp_only_layers, and then only every decoder_sparse_step-th one (1: all)."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (i not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (i + 1) % step == 0)


def refuse_quantized(config, family: str) -> None:
    """For a family whose checkpoints hold the experts fused only (GraniteMoE): quantized
    experts are read one by one."""
    if getattr(config, "quantization_config", None):
        raise ValueError(f"quantized {family} checkpoints are not supported yet: {family} "
                         f"stores its experts fused (input_linear / output_linear), and "
                         f"tpserve reads quantized experts stored one by one; serve the bf16 "
                         f"or fp16 checkpoint")


# The tensors of a float linear layer (and DeepSeek-V3's router bias); anything else under a
# router is a quantized one's.
FLOAT_TENSORS = ("weight", "bias", "e_score_correction_bias")


class ExpertTensors:
    """blocks: the checkpoint's names of a layer's sparse block, as a regex alternative
    ("mlp"; Mixtral's per-expert tensors sit under "block_sparse_moe")."""

    def __init__(self, layers: nn.ModuleList, blocks: str = "mlp",
                 fused_names: dict[str, str] | None = None) -> None:
        """fused_names: other names of the fused tensors under the block, each mapped to
        "gate_up_proj" or "down_proj" (GraniteMoE's input_linear.weight, output_linear.weight)."""
        self.layers = layers
        layer = r"(?:model\.)?layers\.(\d+)"  # "model." may be missing (loader.with_prefix)
        self.per_expert = re.compile(rf"{layer}\.(?:{blocks})\.experts\.(\d+)\.(\w+)\.(\w+)$")
        self.router = re.compile(rf"{layer}\.(?:{blocks})\.(gate|shared_expert_gate)\.(\w+)$")
        self.fused_names = {"experts.gate_up_proj": "gate_up_proj",
                            "experts.down_proj": "down_proj", **(fused_names or {})}
        names = "|".join(re.escape(n) for n in self.fused_names)
        self.fused = re.compile(rf"{layer}\.(?:{blocks})\.({names})$")
        self.seen: set[tuple[int, int, str]] = set()

    def moe(self, i: int, w: TensorSlice) -> SparseMoE:
        if i >= len(self.layers):
            raise CheckpointError(f"checkpoint tensor {w.name!r} names layer {i}, but the "
                                  f"config has {len(self.layers)}")
        mlp = self.layers[i].mlp
        if not isinstance(mlp, SparseMoE):
            raise CheckpointError(f"checkpoint tensor {w.name!r} is an expert of layer {i}, "
                                  f"which the config makes dense (mlp_only_layers, "
                                  f"decoder_sparse_step)")
        return mlp

    def others(self, tensors: Iterable[TensorSlice]) -> Iterator[TensorSlice]:
        """The tensors that are not experts; the experts are loaded on the way."""
        for w in tensors:
            if (m := self.router.match(w.name)) and m[3] not in FLOAT_TENSORS:
                raise CheckpointError(
                    f"checkpoint tensor {w.name!r}: the router {m[2]!r} of layer {m[1]} is "
                    f"stored quantized; tpserve keeps routers float, as the released "
                    f"quantized mixture-of-experts checkpoints store them")
            if (m := self.per_expert.match(w.name)) and (
                    m[4] == "weight" or self.moe(int(m[1]), w).experts is not None):
                i, e = int(m[1]), int(m[2])
                moe = self.moe(i, w)
                part = {name: p for p, name in moe.names.items()}.get(m[3])
                if part is None:
                    raise CheckpointError(f"checkpoint tensor {w.name!r}: expert projections "
                                          f"are named {', '.join(moe.names.values())}")
                if moe.experts is not None:  # quantized: the expert's own layers load it
                    moe.check_expert(e, w)
                    yield w
                    continue
                moe.load_expert(e, part, w)
                self.seen.add((i, e, part))
            elif m := self.fused.match(w.name):
                i, moe, which = int(m[1]), self.moe(int(m[1]), w), self.fused_names[m[2]]
                if moe.experts is not None:
                    raise CheckpointError(
                        f"checkpoint tensor {w.name!r}: experts stored fused in a quantized "
                        f"checkpoint; tpserve reads quantized experts stored one by one "
                        f"(experts.{{e}}.{moe.names['gate']}.* ...)")
                moe.load_fused(which, w)
                parts = ("down",) if which == "down_proj" else ("gate", "up")
                self.seen.update((i, e, p) for e in range(moe.num_experts) for p in parts)
            else:
                yield w

    def check(self) -> None:
        """Every expert of every sparse layer loaded, or a CheckpointError naming those not
        (quantized experts: load_into checks their parameters)."""
        # dict.fromkeys: a fused tensor is every expert's, named once.
        missing = [*dict.fromkeys(layer.mlp.tensor_name(e, p) for i, layer in enumerate(self.layers)
                   if isinstance(layer.mlp, SparseMoE) and layer.mlp.experts is None
                   for e in range(layer.mlp.num_experts) for p in PARTS
                   if (i, e, p) not in self.seen)]
        if missing:
            raise CheckpointError(f"checkpoint has no weights for {len(missing)} expert "
                                  f"tensors: {', '.join(missing[:8])}"
                                  + (" ..." if len(missing) > 8 else ""))
