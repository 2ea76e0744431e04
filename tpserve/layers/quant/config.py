"""Which quantization a checkpoint uses (its config.json `quantization_config`, or --quantize),
and the context that hands it to the linear layers while a model is built.

Layers never read files or flags: build_model enters quant_context(resolve_quant(...)) and
every tensor-parallel linear built inside asks current_quant() for its method.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from tpserve.layers.quant.spec import QuantConfig, QuantizationError  # noqa: F401 - re-exported

QUANTIZE_CHOICES = ("auto", "gptq", "awq", "fp8", "compressed-tensors", "none")


def _checkpoint_quant(hf_config) -> dict | None:
    q = getattr(hf_config, "quantization_config", None)
    if q is None:
        return None
    return q if isinstance(q, dict) else q.to_dict()


def resolve_quant(requested: str, hf_config, kernel: str = "auto") -> QuantConfig | None:
    """requested: one of QUANTIZE_CHOICES. auto follows the checkpoint; an explicit method must
    agree with it, except fp8, which may also cast an unquantized checkpoint at load."""
    if requested not in QUANTIZE_CHOICES:
        raise QuantizationError(f"--quantize {requested!r}: choose one of {', '.join(QUANTIZE_CHOICES)}")
    q = _checkpoint_quant(hf_config)
    found = (q or {}).get("quant_method")
    if found == "mxfp4":
        return _mxfp4(requested, hf_config)
    if requested == "none":
        if found:
            raise QuantizationError(
                f"the checkpoint is quantized ({found}); --quantize none cannot serve it. Use "
                "--quantize auto, or pass an unquantized checkpoint")
        return None
    if requested == "auto":
        return _parse(q, kernel) if found else None
    if found is None:
        if requested == "fp8":
            return QuantConfig("fp8", bits=8, cast_at_load=True, kernel=kernel)
        raise QuantizationError(
            f"--quantize {requested}: the checkpoint has no quantization_config in config.json. "
            f"tpserve reads {requested} checkpoints but does not quantize to {requested} itself; "
            "use --quantize fp8 to cast an unquantized checkpoint at load")
    if found != requested:
        raise QuantizationError(
            f"--quantize {requested} but the checkpoint's quantization_config says {found!r}; "
            "use --quantize auto")
    return _parse(q, kernel)


# Families whose MXFP4 tensors tpserve reads, dequantized at load (their layers run float).
MXFP4_FAMILIES = ("GptOssForCausalLM",)


def _mxfp4(requested: str, hf_config) -> None:
    """gpt-oss's released checkpoints store their experts as MXFP4: the family's loader
    dequantizes them into the model dtype (layers/quant/mxfp4.py), so no layer is quantized."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    if getattr(hf_config, "model_type", None) != "gpt_oss" and \
            not any(a in MXFP4_FAMILIES for a in archs):
        raise QuantizationError(
            f"quantization method 'mxfp4' is read only for {', '.join(MXFP4_FAMILIES)} "
            f"(its experts, dequantized at load), not {archs or 'this model'}: serve a bf16 "
            f"or fp16 checkpoint")
    if requested not in ("auto", "none"):
        raise QuantizationError(
            f"--quantize {requested}: this checkpoint stores its experts as mxfp4, which "
            f"tpserve dequantizes into the model dtype at load; use --quantize auto")
    return None


def _parse(q: dict, kernel: str) -> QuantConfig:
    method = q["quant_method"]
    if q.get("lm_head"):
        raise QuantizationError(
            f"this {method} checkpoint quantizes lm_head too (quantization_config.lm_head = "
            "true); tpserve keeps the LM head in float: use a checkpoint with a float head")
    if method == "gptq":
        layout = "marlin" if q.get("is_marlin_format") else q.get("checkpoint_format", "gptq")
        if layout not in ("gptq", "gptq_v2"):
            raise QuantizationError(
                f"GPTQ checkpoint_format {layout!r} is not supported; tpserve reads the gptq and "
                "gptq_v2 layouts (qweight, qzeros, scales, g_idx): use the checkpoint's gptq "
                "release")
        return _int4(q, method, kernel, desc_act=bool(q.get("desc_act", False)),
                     sym=bool(q.get("sym", True)),
                     zero_offset=0 if layout == "gptq_v2" else 1)
    if method == "awq":
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationError(
                f"AWQ version {version!r} is not supported; tpserve reads the GEMM layout "
                "(quantization_config.version = 'gemm')")
        if not q.get("zero_point", True):
            raise QuantizationError("AWQ without zero points is not supported")
        return _int4(q, method, kernel, desc_act=False, sym=False, zero_offset=0,
                     skip=tuple(q.get("modules_to_not_convert") or ()))
    if method == "fp8":
        fmt = str(q.get("fmt", "e4m3")).lower()
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise QuantizationError(
                f"fp8 checkpoint format {q.get('fmt')!r} (quantization_config.fmt) is not "
                "supported; tpserve reads e4m3 weights (float8_e4m3fn)")
        block = q.get("weight_block_size")  # [rows, columns] per scale of weight_scale_inv
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2 or
                                  not all(isinstance(b, int) and b > 0 for b in block)):
            raise QuantizationError(
                f"fp8 weight_block_size {block!r}: tpserve reads two positive integers, [output "
                "rows, input columns] per scale of weight_scale_inv (e.g. [128, 128])")
        return QuantConfig("fp8", bits=8, kernel=kernel, block=tuple(block) if block else None,
                           dynamic_activations=q.get("activation_scheme") == "dynamic",
                           skip_modules=tuple(q.get("modules_to_not_convert") or ()))
    if method == "compressed-tensors":
        from tpserve.layers.quant.compressed_tensors import parse_config

        return parse_config(q, kernel)
    raise QuantizationError(
        f"quantization method {method!r} is not supported; tpserve serves gptq (4-bit), awq "
        "(4-bit GEMM), fp8 (e4m3) and compressed-tensors (fp8, 4-bit) checkpoints")


def _int4(q: dict, method: str, kernel: str, *, desc_act: bool, sym: bool, zero_offset: int,
          skip: tuple[str, ...] = ()) -> QuantConfig:
    bits = int(q.get("bits", q.get("w_bit", 4)))
    if bits != 4:
        raise QuantizationError(f"{method} with {bits} bits is not supported; tpserve reads 4-bit")
    group = int(q.get("group_size", q.get("q_group_size", 128)))
    return QuantConfig(method, bits=bits, group_size=group, desc_act=desc_act, sym=sym,
                       zero_offset=zero_offset, kernel=kernel, skip_modules=skip)


_CURRENT: contextvars.ContextVar[QuantConfig | None] = contextvars.ContextVar(
    "tpserve_quant", default=None)


@contextlib.contextmanager
def quant_context(cfg: QuantConfig | None) -> Iterator[QuantConfig | None]:
    token = _CURRENT.set(cfg)
    try:
        yield cfg
    finally:
        _CURRENT.reset(token)


def current_quant() -> QuantConfig | None:
    return _CURRENT.get()


def refuse_checkpoint_quant(architecture: str) -> None:
    """For a family whose layers load float weights only (T5): a quantized checkpoint is
    refused while the model is built, which the launcher does on the meta device before any
    shard starts; --quantize fp8 (a cast at load) is served."""
    q = current_quant()
    if q is not None and not q.cast_at_load:
        raise QuantizationError(
            f"{architecture} checkpoints quantized with {q.method} are not supported: tpserve "
            "serves gptq, awq, fp8 and compressed-tensors checkpoints of the families whose "
            "layers load them (Llama, Mistral, Gemma, Qwen, Phi, Bloom, GPT-NeoX, GPTBigCode, "
            "Falcon, Cohere's int4, the mixtures of experts; docs/quantization.md). Serve the "
            "float checkpoint instead, with --quantize fp8 to cast its weights to e4m3 at load")
