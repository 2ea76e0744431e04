"""How a tensor-parallel linear layer holds and applies its weight: float, int4 (GPTQ/AWQ) or
fp8. A method registers the layer's parameters (each with its ParamLayout, so the layer's
one loader slices them) and computes x @ W^T without the bias; the layer adds the bias and,
for row-parallel layers, the all-reduce."""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import torch
from torch import nn

from tpserve.errors import CheckpointError, ShardingError
from tpserve.kernels import gemv
from tpserve.kernels.kv_quant import FP8_MAX
from tpserve.kernels.quant import w8a8
from tpserve.layers.param_layout import FLOAT_WEIGHT, VECTOR, ParamLayout, attach
from tpserve.layers.quant.compressed_tensors import note_once
from tpserve.layers.quant.config import QuantConfig, QuantizationError, current_quant
from tpserve.layers.quant.packing import awq_qweight_to_rows, zeros_from_packed

log = logging.getLogger(__name__)


def _param(shape, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LinearMethod:
    # Checkpoint tensor names this method stores under other parameter names (None: read
    # nothing from it); the loader (models/loader.py) renames them.
    checkpoint_names: dict[str, str | None] = {}

    def create(self, layer: nn.Module, out_per_rank: int, in_per_rank: int, *, in_total: int,
               row_parallel: bool, part_sizes: list[int], prefix: str) -> None:
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_normed(self, layer: nn.Module, x: torch.Tensor, eps: float) -> torch.Tensor:
        """apply() of x divided by its root mean square (an RMSNorm whose weight was folded
        into this layer's, RMSNorm.fold_into)."""
        return self.apply(layer, gemv.rms_unit(x, eps))

    def apply_add(self, layer: nn.Module, x: torch.Tensor,
                  residual: torch.Tensor) -> torch.Tensor:
        """residual + apply(): a tp = 1 row-parallel layer adding its output to the
        residual stream."""
        return self.apply(layer, x) + residual

    def apply_gated(self, layer: nn.Module, x: torch.Tensor,
                    gelu_tanh: bool) -> torch.Tensor | None:
        """act(x W_gate^T) * (x W_up^T) for a [gate; up] layer with no bias, in one launch,
        or None where this method has none for x (GatedActivation.project then runs the
        layer and the activation)."""
        return None

    def pack(self, layer: nn.Module, dtype: torch.dtype) -> bool:
        """Warmup: hold the weight in the layout its kernel reads fastest, where that differs
        from the stored one; True when repacked. Default: keep it."""
        return False

    def fold_norm(self, layer: nn.Module, norm: nn.Module) -> None:
        """Take the RMSNorm in front of `layer`, so that apply_normed applies it (the norm's
        own launch then only runs for steps of several rows)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take a norm")

    def why_not_fused_one_row(self, layer: nn.Module, dtype: torch.dtype,
                              normed: bool) -> str | None:
        """None where a one-row apply_normed (normed) or apply_add costs no launch of its
        own for x of dtype, else why (LlamaModel.fold_norms folds only where both do)."""
        return f"{type(self).__name__} has no such launch"


class UnquantizedMethod(LinearMethod):
    """Float weights. The one-row GEMV also does the two extras above in the same launch."""

    def create(self, layer, out_per_rank, in_per_rank, **_) -> None:
        layer.weight = attach(_param((out_per_rank, in_per_rank)), FLOAT_WEIGHT)
        layer.gemv_tile = None  # set by warmup where the one-row GEMV beats F.linear

    def apply(self, layer, x):
        return gemv.linear(x, layer.weight, layer.gemv_tile)

    def apply_normed(self, layer, x, eps):
        return gemv.linear(x, layer.weight, layer.gemv_tile, rms_eps=eps)

    def apply_add(self, layer, x, residual):
        return gemv.linear(x, layer.weight, layer.gemv_tile, residual=residual)

    def fold_norm(self, layer, norm):
        norm.fold_into(layer)  # its weight into ours; it becomes a unit norm

    def why_not_fused_one_row(self, layer, dtype, normed):
        return None if layer.gemv_tile is not None else "warmup kept the vendor GEMM"


def _kernel(cfg: QuantConfig, x: torch.Tensor, method: str):
    from tpserve.kernels.quant.registry import select_quant_kernel

    return select_quant_kernel(cfg.kernel, x.device, x.dtype, method)


def _int4_qweight(cfg: QuantConfig, k_words: int, n: int) -> nn.Parameter:
    """qweight [k_words, N] in the memory order of the int4 kernel this layer will run (chosen
    for the device and dtype it is built with); the loader copies each rank's checkpoint slice
    into it, so the repacking happens per rank, on its slice."""
    from tpserve.kernels.quant.base import empty_qweight
    from tpserve.kernels.quant.registry import select_quant_kernel

    device = torch.get_default_device()
    k_contiguous = device.type != "meta" and select_quant_kernel(
        cfg.kernel, device, torch.get_default_dtype(), "int4").int4_k_contiguous
    return nn.Parameter(empty_qweight(k_words, n, k_contiguous), requires_grad=False)


class Int4Method(LinearMethod):
    """GPTQ and AWQ 4-bit. Column-parallel ranks take whole output columns (multiples of 8,
    the packing); row-parallel ranks take whole input groups, or, with act-order, their input
    rows plus every group's scales (rows of one group are scattered over the input)."""

    tensor_name = "qweight"  # the packed tensor on disk, as refusals name it

    def __init__(self, cfg: QuantConfig) -> None:
        self.cfg = cfg

    def create(self, layer, out_per_rank, in_per_rank, *, in_total, row_parallel, part_sizes,
               prefix) -> None:
        from tpserve.distributed import get_tp

        cfg, tp = self.cfg, get_tp().size
        tensor = f"{prefix}.{self.tensor_name}"
        group = in_total if cfg.group_size <= 0 else cfg.group_size
        for size in part_sizes:
            if size % 8:
                raise ShardingError(
                    f"cannot shard {tensor!r} across tp={tp}: each rank's share of "
                    f"the output features ({size}) must be a multiple of 8, the int4 packing "
                    "of qzeros. Choose a smaller tp.")
        if in_per_rank % 8:
            raise ShardingError(
                f"cannot shard {tensor!r} across tp={tp}: each rank's input "
                f"features ({in_per_rank}) must be a multiple of 8 (8 int4 rows per int32)")
        # Row-parallel without act-order: a rank's rows are whole groups, its scales theirs.
        split_groups = row_parallel and not cfg.desc_act and cfg.group_size > 0
        if split_groups and in_per_rank % group:
            raise ShardingError(
                f"cannot shard {tensor!r} across tp={tp}: a rank's "
                f"{in_per_rank} input features would cut a quantization group (group size "
                f"{group}, {in_total} input features). Choose a tp that divides "
                f"{in_total // group} groups.")
        groups = in_per_rank // group if split_groups else math.ceil(in_total / group)
        self.group = group
        # Two equal fused parts ([gate; up]): a kernel's private layout may pair them up for
        # its gated launch (QuantKernel.int4_pack).
        self.paired = len(part_sizes) == 2 and part_sizes[0] == part_sizes[1]
        self.in_features = in_per_rank
        awq = cfg.method == "awq"
        # Scales keep float16's 11-bit mantissa (what GPTQ and AWQ store) under a bfloat16
        # model; the kernels compute in float32 either way. Zeros are small integers.
        dtype = torch.float32 if torch.get_default_dtype() == torch.float32 else torch.float16
        stored_q = ParamLayout(out_dim=1, in_dim=0, in_per=8)
        qweight = _int4_qweight(cfg, in_per_rank // 8, out_per_rank)
        if awq:
            layer.qweight = attach(qweight, ParamLayout(out_dim=1, out_per=8, in_dim=0), stored_q,
                                   convert=lambda t, _o: awq_qweight_to_rows(t))
        else:
            layer.qweight = attach(qweight, stored_q)
        group_layout = ParamLayout(out_dim=1, in_dim=0, in_per=group, in_sharded=split_groups)
        packed_zeros = ParamLayout(out_dim=1, out_per=8, in_dim=0, in_per=group,
                                   in_sharded=split_groups)
        # Named qzeros as on disk (the loader maps names), but held unpacked in the model dtype.
        layer.qzeros = attach(_param((groups, out_per_rank), dtype), packed_zeros, group_layout,
                              convert=lambda t, _o: zeros_from_packed(t, cfg.zero_offset, dtype,
                                                                      awq))
        layer.scales = attach(_param((groups, out_per_rank), dtype), group_layout)
        layer.g_idx = None
        if cfg.method == "gptq":
            # Without act-order g_idx is k // group_size; read it only to accept the tensor.
            layer.g_idx = attach(_param((in_per_rank,), torch.int32),
                                 ParamLayout(out_dim=None, in_dim=0),
                                 convert=self._same_g_idx(layer, prefix),
                                 optional=not cfg.desc_act)

    @staticmethod
    def _same_g_idx(layer, prefix: str):
        """Fused projections (q/k/v, gate/up) share one g_idx: GPTQ derives act-order from
        their common input, so a checkpoint whose parts disagree cannot be fused."""
        seen = []

        def check(t: torch.Tensor, _out) -> torch.Tensor:
            if seen and not torch.equal(seen[0], t):
                raise CheckpointError(
                    f"the fused projections of {prefix!r} have different act-order g_idx; "
                    "tpserve fuses them and needs one order (re-quantize with the same "
                    "calibration input for every projection that shares an input)")
            seen[:] = [t.clone()]
            return t
        return check

    def pack(self, layer, dtype: torch.dtype) -> bool:
        """Warmup: the layer's qweight in the private layout of the int4 kernel that will run
        it for activations of dtype, where that kernel has one (QuantKernel.int4_pack); the
        stored qweight is freed. True when repacked."""
        qw = layer.qweight
        if qw.device.type == "meta" or getattr(qw, "paired", None) is not None:
            return False  # no weights, or already in a kernel's layout
        g_idx = layer.g_idx if self.cfg.desc_act else None
        x = torch.empty(0, device=qw.device, dtype=dtype)
        packed = _kernel(self.cfg, x, "int4").int4_pack(qw, layer.scales, layer.qzeros,
                                                        self.group, g_idx, dtype, self.paired)
        if packed is None:
            return False
        param = nn.Parameter(packed, requires_grad=False)
        param.paired = getattr(packed, "paired", False)  # a new object: carry the mark over
        layer.qweight = param
        return True

    def apply(self, layer, x):
        shape = x.shape
        g_idx = layer.g_idx if self.cfg.desc_act else None
        y = _kernel(self.cfg, x, "int4").int4_matmul(
            x.reshape(-1, shape[-1]), layer.qweight, layer.scales, layer.qzeros, self.group, g_idx)
        return y.reshape(*shape[:-1], y.shape[-1])

    def fold_norm(self, layer, norm):
        # int4 group scales cannot absorb a per-input weight: the norm stays as it is, and
        # one-row steps multiply x by its weight inside the GEMV.
        self.norm = norm
        self.gamma = (norm.weight.float() + norm.offset).to(norm.weight.dtype)

    def apply_normed(self, layer, x, eps):
        norm = getattr(self, "norm", None)
        if norm is None:
            raise RuntimeError(f"{type(self).__name__}.apply_normed before fold_norm")
        shape = x.shape
        g_idx = layer.g_idx if self.cfg.desc_act else None
        y = None
        if x.numel() == shape[-1] and self.gamma.dtype == x.dtype:
            y = _kernel(self.cfg, x, "int4").int4_normed_matmul(
                x.reshape(1, -1), layer.qweight, layer.scales, layer.qzeros, self.group,
                self.gamma, eps, g_idx)
        if y is None:
            return self.apply(layer, norm(x))
        return y.reshape(*shape[:-1], y.shape[-1])

    def apply_add(self, layer, x, residual):
        shape = x.shape
        y = None
        if x.numel() == shape[-1]:
            g_idx = layer.g_idx if self.cfg.desc_act else None
            y = _kernel(self.cfg, x, "int4").int4_add_matmul(
                x.reshape(1, -1), layer.qweight, layer.scales, layer.qzeros, self.group,
                residual.reshape(1, -1), g_idx)
        if y is None:
            return self.apply(layer, x) + residual
        return y.reshape(*shape[:-1], y.shape[-1])

    def why_not_fused_one_row(self, layer, dtype, normed):
        """Asks the kernel with a row of zeros (warmup time: this also compiles the launch
        the decode graphs will capture)."""
        k, n = self.in_features, layer.scales.shape[1]  # qweight may be a kernel's own layout
        x = torch.zeros(1, k, dtype=dtype, device=layer.qweight.device)
        kernel = _kernel(self.cfg, x, "int4")
        g_idx = layer.g_idx if self.cfg.desc_act else None
        if normed:
            y = kernel.int4_normed_matmul(x, layer.qweight, layer.scales, layer.qzeros,
                                          self.group, torch.ones(k, dtype=dtype,
                                                                 device=x.device), 1e-6, g_idx)
        else:
            y = kernel.int4_add_matmul(x, layer.qweight, layer.scales, layer.qzeros,
                                       self.group, torch.zeros(1, n, dtype=dtype,
                                                               device=x.device), g_idx)
        what = "normalises its input" if normed else "adds the residual"
        return None if y is not None else \
            f"its int4 kernel ({kernel.name}) has no one-row launch that {what} for {dtype}"

    def apply_gated(self, layer, x, gelu_tanh):
        if self.cfg.desc_act:
            return None
        shape = x.shape
        y = _kernel(self.cfg, x, "int4").int4_gated_matmul(
            x.reshape(-1, shape[-1]), layer.qweight, layer.scales, layer.qzeros, self.group,
            gelu_tanh)
        return None if y is None else y.reshape(*shape[:-1], y.shape[-1])


class Fp8Method(LinearMethod):
    """e4m3 weights with one float32 scale per output channel, or per block of the weight
    (weight_block_size). A checkpoint's per-tensor scale is broadcast to its channels;
    --quantize fp8 casts float weights per channel of the rank's slice while loading (so
    row-parallel ranks scale their own columns)."""

    def __init__(self, cfg: QuantConfig) -> None:
        self.cfg = cfg
        self.block: tuple[int, int] | None = None  # (rows, columns) per held scale

    def create(self, layer, out_per_rank, in_per_rank, *, row_parallel, part_sizes, prefix,
               **_) -> None:
        fp8 = torch.float8_e4m3fn
        if self.cfg.block is not None:
            self._create_blocks(layer, out_per_rank, in_per_rank, row_parallel, part_sizes,
                                prefix)
        else:
            layer.weight_scale = attach(_param((out_per_rank,), torch.float32), VECTOR,
                                        convert=lambda t, _o: t.reshape(-1).float(),
                                        optional=self.cfg.cast_at_load)
        convert = self._cast(layer) if self.cfg.cast_at_load else None
        layer.weight = attach(_param((out_per_rank, in_per_rank), fp8), FLOAT_WEIGHT,
                              convert=convert)

    def _create_blocks(self, layer, out_per_rank: int, in_per_rank: int, row_parallel: bool,
                       part_sizes: list[int], prefix: str) -> None:
        """weight_scale_inv, one scale per (rows x columns) block of this rank's weight. Where
        a rank's slice, or a fused part, starts inside a checkpoint block, the blocks held are
        smaller (the gcd of the block and those offsets), each inside one checkpoint block and
        holding its scale: exact at any tp, for a few more scale bytes."""
        from tpserve.distributed import get_tp

        bn, bk = self.cfg.block
        split = get_tp().size > 1
        if row_parallel:  # a rank's columns start at rank * in_per_rank
            rows, cols = bn, math.gcd(bk, in_per_rank) if split else bk
        else:  # each part starts at a multiple of its size (rank * size, or after the others)
            rows, cols = math.gcd(bn, *part_sizes[:-1], *(part_sizes if split else ())), bk
        self.block = (rows, cols)
        if self.block != (bn, bk):
            _log_once(("blocks", bn, bk, rows, cols),
                      f"fp8 {bn} x {bk} block scales held as {rows} x {cols} blocks, each with "
                      f"its checkpoint block's scale (exact), where a rank's slice or a fused "
                      f"part starts inside a block (first: {prefix})")
        shape = (math.ceil(out_per_rank / rows), math.ceil(in_per_rank / cols))
        layer.weight_scale_inv = attach(
            _param(shape, torch.float32), ParamLayout(out_per=bn, in_per=bk, blocked=True),
            ParamLayout(out_per=rows, in_per=cols, blocked=True),
            convert=lambda t, _o: t.float())

    @staticmethod
    def _cast(layer):
        def cast(w: torch.Tensor, out: tuple[int, int, int]) -> torch.Tensor:
            w = w.float()
            scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
            _, n, dst = out
            layer.weight_scale.data[dst:dst + n] = scale
            return (w / scale.unsqueeze(1)).to(torch.float8_e4m3fn)
        return cast

    def apply(self, layer, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.block is not None:
            if self.cfg.dynamic_activations and x2.shape[0] > w8a8.MIN_ROWS:
                _log_once(("weight-only",),
                          "fp8 layers with block scales stay weight-only at every batch size "
                          "(the checkpoint's dynamic activation scheme is not used): W8A8's "
                          "row-wise scaled matmul takes one scale per weight column")
            y = _kernel(self.cfg, x, "fp8").fp8_matmul(x2, layer.weight, layer.weight_scale_inv,
                                                       block=self.block)
        elif self.cfg.dynamic_activations and x2.shape[0] > w8a8.MIN_ROWS and \
                _w8a8_here(x2, layer.weight):
            y = w8a8.w8a8_matmul(x2, layer.weight, layer.weight_scale)
        else:
            y = _kernel(self.cfg, x, "fp8").fp8_matmul(x2, layer.weight, layer.weight_scale)
        return y.reshape(*shape[:-1], y.shape[-1])


_LOGGED: set[tuple] = set()


def _log_once(key: tuple, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(msg)


_W8A8_LOGGED: set[tuple] = set()


def _w8a8_here(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether W8A8 runs for this device, dtype and weight shape; logged once per kind."""
    reason = w8a8.why_not(x, weight)
    key = (x.device, x.dtype, reason)
    if key not in _W8A8_LOGGED:
        _W8A8_LOGGED.add(key)
        if reason is None:
            log.info("fp8 layers on %s: batches above %d rows round activations to e4m3 per "
                     "row (the checkpoint's dynamic activation scheme) and multiply on the fp8 "
                     "tensor cores", x.device, w8a8.MIN_ROWS)
        else:
            log.info("fp8 layers on %s stay weight-only at every batch size: %s", x.device,
                     reason)
    return reason is None


def linear_method(prefix: str, parts: list[str] | None = None) -> LinearMethod:
    """The method for the linear layer being built, named by its checkpoint prefix; parts:
    the checkpoint modules fused into it (default: the prefix)."""
    cfg = current_quant()
    if cfg is None or _skipped(cfg, prefix, parts or [prefix]):
        return UnquantizedMethod()
    if cfg.method == "compressed-tensors":
        return CtInt4Method(cfg)
    return Fp8Method(cfg) if cfg.method == "fp8" else Int4Method(cfg)


def _skipped(cfg: QuantConfig, prefix: str, parts: list[str]) -> bool:
    """Whether the checkpoint keeps this layer float. A skip_modules entry is a fragment of
    the prefix (AWQ's modules_to_not_convert), or "re:" and a regex matched at the start of
    each fused part's name (compressed-tensors' ignore), which must match all parts or none."""
    if any(s and not s.startswith("re:") and s in prefix for s in cfg.skip_modules):
        return True
    regexes = [re.compile(s[3:]) for s in cfg.skip_modules if s.startswith("re:")]
    float_parts = [p for p in parts if any(r.match(p) for r in regexes)]
    if float_parts and len(float_parts) < len(parts):
        raise QuantizationError(
            f"the checkpoint keeps {float_parts} float but quantizes "
            f"{[p for p in parts if p not in float_parts]}; tpserve runs them as one fused "
            "layer, all float or all quantized")
    return bool(float_parts)


class CtInt4Method(Int4Method):
    """Int4Method over pack-quantized tensors: each is GPTQ's tensor transposed (output
    features first), read through the same layouts with the dims swapped, so a rank reads
    only its slice and the sharding rules and refusals are GPTQ's."""

    tensor_name = "weight_packed"
    checkpoint_names = {"weight_packed": "qweight", "weight_scale": "scales",
                        "weight_zero_point": "qzeros", "weight_shape": None}

    def create(self, layer, out_per_rank, in_per_rank, *, prefix, **kw) -> None:
        super().create(layer, out_per_rank, in_per_rank, prefix=prefix, **kw)
        for name in ("qweight", "scales", "qzeros"):
            p = getattr(layer, name)
            convert = _exact_scales(p.dtype, f"{prefix}.weight_scale") if name == "scales" \
                else p.convert
            attach(p, _swap(p.src_layout), p.dst_layout, _transposed(convert), p.optional)
        if self.cfg.sym:  # no zero points on disk: the stored nibble 8 is zero
            layer.qzeros.optional = True
            layer.qzeros.data.fill_(8)


def _swap(layout: ParamLayout) -> ParamLayout:
    return dataclasses.replace(layout, out_dim=layout.in_dim, in_dim=layout.out_dim)


def _transposed(convert):
    if convert is None:
        return lambda t, _out: t.t()
    return lambda t, out: convert(t.t(), out)


def _exact_scales(dtype: torch.dtype, name: str):
    """Scales become the layer's scale dtype (float16 under a bfloat16 model, as GPTQ's);
    a bfloat16 checkpoint's scales below float16's normal range lose bits there."""
    def cast(t: torch.Tensor, _out) -> torch.Tensor:
        s = t.to(dtype)
        if not torch.isfinite(s).all():
            raise CheckpointError(f"{name!r}: scales outside the range of {dtype}")
        if not torch.equal(s.to(t.dtype), t):
            err = ((s.double() - t.double()).abs() / t.double().abs().clamp(min=1e-30)).max()
            note_once("compressed-tensors scales of %s (and maybe other layers) are not exact in "
                  "%s, which tpserve keeps int4 scales in: largest relative change %.2g",
                  name, dtype, err.item())
        return s
    return cast
