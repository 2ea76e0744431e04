"""What a quantized checkpoint holds, as the layers see it (QuantConfig), and the error a
checkpoint that cannot be served raises. Kept apart from config.py, which resolves a
checkpoint's quantization_config into a QuantConfig, so that the per-format parsers
(compressed_tensors.py) depend on these types without depending on that resolver."""

from __future__ import annotations

from dataclasses import dataclass


class QuantizationError(ValueError):
    """A checkpoint's quantization cannot be served as asked; the message says what to do."""


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "gptq" | "awq" | "fp8" | "compressed-tensors" (its int4; its fp8 is "fp8")
    bits: int = 4
    group_size: int = 128  # input features per scale/zero (int4); -1 in a checkpoint = whole row
    desc_act: bool = False  # GPTQ act-order: g_idx maps each input row to its group
    sym: bool = True
    # GPTQ v1 checkpoints store zero - 1 ("gptq"); gptq_v2 and AWQ store the zero itself.
    zero_offset: int = 0
    # fp8 only: True when the checkpoint holds bf16/fp32 weights cast to e4m3 at load.
    cast_at_load: bool = False
    # fp8 only: the checkpoint's activation_scheme is "dynamic": batches above 16 rows round
    # activations to e4m3 per row and use the fp8 tensor cores where the GPU has them
    # (kernels/quant/w8a8.py); otherwise, and always with "static" or a cast, weight-only.
    dynamic_activations: bool = False
    # fp8 only: the checkpoint's weight_block_size [output rows, input columns]: weight_scale_inv
    # holds one scale per block of the weight (None: per-channel or per-tensor weight_scale).
    block: tuple[int, int] | None = None
    kernel: str = "auto"  # int4 kernel: auto, torch, triton or a tpserve.quant_kernels plugin
    # modules left unquantized: name fragments (AWQ modules_to_not_convert), or "re:" and a
    # regex matched at the start of a module's name (compressed-tensors' ignore)
    skip_modules: tuple[str, ...] = ()
    # The checkpoint names every Linear it keeps float (compressed-tensors' ignore, with
    # targets ["Linear"]), so a Linear not named is quantized; GPTQ's, AWQ's and fp8's lists
    # of modules left float are not complete (their routers are float without being named).
    explicit_float: bool = False

    def describe(self) -> str:
        if self.method == "fp8":
            scales = f"{self.block[0]} x {self.block[1]} block scales" if self.block \
                else "per-channel scales"
            return f"fp8 e4m3 weights, {scales}" + (
                " (cast from the checkpoint at load)" if self.cast_at_load else "") + (
                "" if not self.dynamic_activations else
                ", weight-only (W8A8 takes no block scales)" if self.block else
                ", dynamic e4m3 activations above 16 rows where supported")
        act = ", act-order" if self.desc_act else ""
        return f"{self.method} int{self.bits}, group size {self.group_size}{act}, " \
               f"{'symmetric' if self.sym else 'asymmetric'}"
