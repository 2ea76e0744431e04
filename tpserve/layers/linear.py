"""Linear layers split across tensor-parallel ranks.

Column-parallel layers split the output features (no communication); row-parallel layers
split the input features and all-reduce their partial sums in forward. Pairing a column
layer with a row layer (QKV -> o_proj, gate_up -> down) costs one all-reduce per pair.

How a layer holds its weight (float, int4 GPTQ/AWQ, fp8) is its LinearMethod
(layers/quant/methods.py); every parameter records its ParamLayout (layers/param_layout.py),
so the loaders below speak in output and input features and never in tensor dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpserve.distributed import all_reduce, get_tp
from tpserve.errors import ShardingError
from tpserve.layers import lora
from tpserve.layers.param_layout import VECTOR, attach, expect_full, load_region
from tpserve.layers.quant.methods import linear_method
from tpserve.layers.sharding import copy_full, shard_size
from tpserve.weights import TensorSlice


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.weight.weight_loader = copy_full
        self.bias = None
        if bias:
            self.bias = _param(out_features)
            self.bias.weight_loader = copy_full

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _build(layer: nn.Module, out_per_rank: int, in_per_rank: int, in_total: int, bias: bool,
           bias_size: int, row_parallel: bool, part_sizes: list[int], prefix: str, loader,
           parts: list[str] | None = None) -> None:
    """Create the layer's weight parameters through its method, a bias, and their loaders.
    parts: the checkpoint modules fused into the layer (a quantized checkpoint may keep some
    float)."""
    layer.method = linear_method(prefix, parts)
    layer.method.create(layer, out_per_rank, in_per_rank, in_total=in_total,
                        row_parallel=row_parallel, part_sizes=part_sizes, prefix=prefix)
    layer.bias = attach(_param(bias_size), VECTOR) if bias else None
    layer.lora = None  # LoraWeights once adapters target this layer (worker/lora_loader.py)
    for p in layer.parameters(recurse=False):
        p.weight_loader = loader


class ColumnParallelLinear(nn.Module):
    """y = x W^T, W split by output rows; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 prefix: str = "") -> None:
        super().__init__()
        tp = get_tp()
        self.prefix = prefix
        self.out_per_rank = shard_size(out_features, tp.size, tensor=f"{prefix}.weight",
                                       what="output features", shape=(out_features, in_features))
        self.in_features, self.out_features = in_features, out_features
        _build(self, self.out_per_rank, in_features, in_features, bias, self.out_per_rank,
               False, self.rank_parts(), prefix, self.load_rows, self.checkpoint_modules())

    def rank_parts(self) -> list[int]:
        """Output features of each fused projection on this rank (one, unless fused)."""
        return [self.out_per_rank]

    def checkpoint_modules(self) -> list[str]:
        """The checkpoint modules this layer holds (one, unless fused)."""
        return [self.prefix]

    def lora_regions(self) -> list[list[tuple[int, int, int]]]:
        """Per checkpoint module: (first output row in that module, rows, row in this rank's
        output) of each region this rank holds; where a LoRA B's rows go."""
        n = self.out_per_rank
        return [[(get_tp().rank * n, n, 0)]]

    def load_rows(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        n = self.out_per_rank
        expect_full(param, w, n * get_tp().size, self.in_features)
        load_region(param, w, (get_tp().rank * n, n, 0), (0, self.in_features))

    def forward(self, x: torch.Tensor, rms_eps: float | None = None) -> torch.Tensor:
        """rms_eps: x is the residual stream, to be divided by its root mean square first (the
        RMSNorm in front of this layer has its weight folded into this one's,
        RMSNorm.fold_into); the one-row GEMV does that inside its launch."""
        y = (self.method.apply(self, x) if rms_eps is None
             else self.method.apply_normed(self, x, rms_eps))
        y = y + self.bias if self.bias is not None else y
        # No fold with adapters (Worker._fold_norms): x is the normalised input here.
        return y if self.lora is None else self.lora.add(y, x)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (gate and up of an MLP).
    shard_id i is the i-th projection as it is stored on disk."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 prefix: str = "", part_names: list[str] | None = None,
                 what: str = "output features", disk_name: str | None = None) -> None:
        """what: the size a refusal names; disk_name: the tensor holding every part where
        the checkpoint stores them fused (Phi-3's gate_up_proj), which a refusal names."""
        tp = get_tp().size
        names = part_names or [str(i) for i in range(len(out_sizes))]
        for size, name in zip(out_sizes, names):
            tensor, shape = (f"{prefix}.{name}.weight", (size, in_features)) if disk_name is None \
                else (f"{prefix}.{disk_name}.weight", (sum(out_sizes), in_features))
            shard_size(size, tp, tensor=tensor, what=what, shape=shape)
        self.out_sizes = list(out_sizes)
        self.part_modules = [f"{prefix}.{disk_name}"] if disk_name is not None else \
            [f"{prefix}.{name}" for name in part_names] if part_names else [prefix]
        super().__init__(in_features, sum(out_sizes), bias, prefix)

    def rank_parts(self) -> list[int]:
        return [s // get_tp().size for s in self.out_sizes]

    def checkpoint_modules(self) -> list[str]:
        return self.part_modules

    def lora_regions(self) -> list[list[tuple[int, int, int]]]:
        tp = get_tp()
        fused_on_disk = len(self.part_modules) == 1
        regions, src_base, dst = [], 0, 0
        for size in self.out_sizes:
            n = size // tp.size
            regions.append((src_base + tp.rank * n, n, dst))
            dst += n
            src_base += size if fused_on_disk else 0
        return [regions] if fused_on_disk else [[r] for r in regions]

    def load_rows(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        tp = get_tp()
        if shard_id is None:  # stored fused on disk ([gate; up]): take each part's slice
            expect_full(param, w, sum(self.out_sizes), self.in_features)
            parts = range(len(self.out_sizes))
        else:
            expect_full(param, w, self.out_sizes[shard_id], self.in_features)
            parts = [shard_id]
        for i in parts:
            n = self.out_sizes[i] // tp.size
            src = (sum(self.out_sizes[:i]) if shard_id is None else 0) + tp.rank * n
            dst = sum(s // tp.size for s in self.out_sizes[:i])
            load_region(param, w, (src, n, dst), (0, self.in_features))


def _tps_that_work(heads: int, kv_heads: int) -> str:
    """The tps whose ranks each get whole query heads and whole (or replicated) KV heads."""
    ok = [str(t) for t in range(1, heads + 1)
          if heads % t == 0 and (kv_heads % t == 0 or t % kv_heads == 0)]
    listed = ok[0] if len(ok) == 1 else f"{', '.join(ok[:-1])} or {ok[-1]}"
    return f"Its attention heads shard at tp = {listed}."


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads. When tp exceeds the KV heads, each KV head
    is replicated on tp / num_kv_heads ranks (rank r holds KV head r * num_kv_heads // tp)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, prefix: str = "",
                 part_names: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj"),
                 disk_name: str | None = None) -> None:
        """disk_name: the one [q; k; v] tensor where the checkpoint stores them fused (Phi-3's
        qkv_proj), which a refusal names instead of the parts."""
        tp = get_tp()
        self.head_dim = head_dim
        qn, kn, _ = part_names
        q_tensor = (f"{prefix}.{qn}.weight", [num_heads * head_dim, hidden])
        kv_tensor = (f"{prefix}.{kn}.weight", [num_kv_heads * head_dim, hidden])
        if disk_name is not None:
            q_tensor = kv_tensor = (f"{prefix}.{disk_name}.weight",
                                    [(num_heads + 2 * num_kv_heads) * head_dim, hidden])

        def refuse(tensor: tuple[str, list[int]], rule: str) -> ShardingError:
            return ShardingError(f"cannot shard {tensor[0]!r} (shape {tensor[1]}) across "
                                 f"tp={tp.size}: {rule}. {_tps_that_work(num_heads, num_kv_heads)}")

        if num_heads % tp.size:
            raise refuse(q_tensor, f"attention heads = {num_heads} is not divisible by {tp.size}")
        self.num_heads = num_heads // tp.size
        if num_kv_heads >= tp.size:
            if num_kv_heads % tp.size:
                raise refuse(kv_tensor, f"key/value heads = {num_kv_heads} is not divisible by "
                                        f"{tp.size}")
            self.num_kv_heads = num_kv_heads // tp.size
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise refuse(kv_tensor, f"{num_kv_heads} key/value heads can be replicated only "
                                        "when tp is a multiple of them")
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        nn.Module.__init__(self)
        self.prefix, self.out_per_rank = prefix, q + 2 * kv
        self.part_modules = [f"{prefix}.{disk_name}"] if disk_name is not None else \
            [f"{prefix}.{name}" for name in part_names]
        self.q_size, self.kv_size = q, kv
        self.in_features, self.out_features = hidden, (num_heads + 2 * num_kv_heads) * head_dim
        _build(self, q + 2 * kv, hidden, hidden, bias, q + 2 * kv, False, [q, kv, kv],
               f"{prefix}.qkv_proj", self.load_rows, self.part_modules)

    def checkpoint_modules(self) -> list[str]:
        return self.part_modules

    def lora_regions(self) -> list[list[tuple[int, int, int]]]:
        if len(self.part_modules) == 3:
            return [[self._rows(part)] for part in "qkv"]
        return [self.fused_regions()]

    def fused_regions(self) -> list[tuple[int, int, int]]:
        """(row in the one fused tensor on disk, rows, row in this rank's weight) of each
        region this rank holds, where the checkpoint stores q, k and v in one tensor: here
        laid out [q; k; v] (Phi-3's qkv_proj); a subclass with other rows overrides it."""
        d = self.head_dim
        bases = (0, self.total_heads * d, (self.total_heads + self.total_kv_heads) * d)
        return [(base + src, n, dst)
                for base, (src, n, dst) in zip(bases, (self._rows(p) for p in "qkv"))]

    def _rows(self, part: str) -> tuple[int, int, int]:
        """(source row in that projection, rows, destination row in the fused weight)."""
        d = self.head_dim
        if part == "q":
            return get_tp().rank * self.num_heads * d, self.q_size, 0
        dst = self.q_size if part == "k" else self.q_size + self.kv_size
        return self.kv_head_start * d, self.kv_size, dst

    def load_rows(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        d, k = self.head_dim, self.in_features
        if shard_id is not None:
            heads = self.total_heads if shard_id == "q" else self.total_kv_heads
            expect_full(param, w, heads * d, k)
            src, n, dst = self._rows(shard_id)
            load_region(param, w, (src, n, dst), (0, k))
            return
        # Stored fused on disk (Phi-3's qkv_proj: [q; k; v]; fused_regions says where).
        expect_full(param, w, self.out_features, k)
        for region in self.fused_regions():
            load_region(param, w, region, (0, k))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; partial sums are all-reduced here, and the
    bias is added after the reduction so it counts once, not tp times."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 prefix: str = "") -> None:
        super().__init__()
        tp = get_tp()
        self.in_per_rank = shard_size(in_features, tp.size, tensor=f"{prefix}.weight",
                                      what="input features", shape=(out_features, in_features))
        self.in_features, self.out_features = in_features, out_features
        self.tp_size, self.prefix = tp.size, prefix
        _build(self, out_features, self.in_per_rank, in_features, bias, out_features, True,
               [out_features], prefix, self.load_cols)

    def load_cols(self, param: nn.Parameter, w: TensorSlice, shard_id=None) -> None:
        n = self.in_per_rank
        expect_full(param, w, self.out_features, self.in_features)
        load_region(param, w, (0, self.out_features, 0), (get_tp().rank * n, n))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: returns residual + this layer's output. With one rank and no bias the
        add happens inside the matmul's launch (the one-row GEMV adds it as it stores)."""
        if (residual is not None and self.tp_size == 1 and self.bias is None
                and not lora.active(self)):
            return self.method.apply_add(self, x, residual)
        y = self.method.apply(self, x)
        y = all_reduce(y if self.lora is None else self.lora.add(y, x))
        y = y + self.bias if self.bias is not None else y
        return y if residual is None else y + residual

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, neither reduced nor biased: for a block that adds it to
        other partial sums and all-reduces them once (Qwen2-MoE's shared expert). A LoRA
        delta joins it here: x_rank A_rank^T B^T summed over ranks is the whole delta."""
        y = self.method.apply(self, x)
        return y if self.lora is None else self.lora.add(y, x)


def row_parallel_sum(*branches: tuple[RowParallelLinear, torch.Tensor]) -> torch.Tensor:
    """The sum of several row-parallel projections, each (layer, its input), with one
    all-reduce: a parallel layer's attention and MLP outputs (GPT-NeoX, Phi) both join the
    stream, so their partial sums are added on each rank and reduced once, then each bias is
    added once. At one decode row a collective costs its latency, so this halves a layer's."""
    y = all_reduce(sum(layer.partial(x) for layer, x in branches))
    for layer, _ in branches:
        if layer.bias is not None:
            y = y + layer.bias
    return y
