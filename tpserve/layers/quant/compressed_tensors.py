"""compressed-tensors checkpoints (llm-compressor's format: `quant_method: compressed-tensors`)
mapped onto the methods tpserve already has, or refused at start naming what they hold.

- fp8 weights (`format: float-quantized`, or `naive-quantized` with float weights): the
  tensors are the fp8 method's own (`weight` e4m3 [N, K], `weight_scale` [1] or [N, 1]).
- 4-bit integer weights (`format: pack-quantized`), per linear of N outputs, K inputs and
  G groups along K (G = 1 for the "channel" strategy):
    weight_packed      int32 [N, K/8]  input 8w + i in bits 4i.. of word w, as q + 8
    weight_scale       float [N, G]
    weight_zero_point  int32 [N/8, G]  asymmetric only: output 8r + i in bits 4i.. of row r,
                                       as z + 8
    weight_shape       int   [2]       (N, K), which config.json already gives
  and the weight is (q - z) * scale with q, z in -8..7: the stored nibbles' difference.
  These are GPTQ's qweight, scales and qzeros transposed, with zeros stored as they are
  (gptq_v2's offset 0), or 8 everywhere for a symmetric scheme; methods.CtInt4Method
  reads them so.
"""

from __future__ import annotations

import logging
import re

from tpserve.layers.quant.spec import QuantConfig, QuantizationError

log = logging.getLogger(__name__)

READS = ("tpserve reads one config_groups scheme targeting every Linear, stored as "
         "float-quantized or naive-quantized fp8 weights (tensor or channel scales; "
         "activations unquantized, fp8 dynamic per token or per tensor, or fp8 static: "
         "served weight-only) or pack-quantized 4-bit integer weights (group or channel "
         "scales, symmetric or not; activations unquantized)")


def parse_config(q: dict, kernel: str) -> QuantConfig:
    """config.json's quantization_config -> the QuantConfig of the method that reads it."""
    name, scheme = _one_scheme(q)
    fmt = scheme.get("format") or q.get("format")
    _refuse_extras(q, name, scheme)
    skip = _ignore_patterns(q.get("ignore") or [])
    w, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    has = f"format {fmt!r}, weights ({_args(w, timing=False)}), activations ({_args(acts)})"
    if w.get("dynamic"):
        raise QuantizationError(f"compressed-tensors {has}: dynamic weight scales; {READS}")
    if fmt in ("float-quantized", "naive-quantized") and w.get("type") == "float" and \
            w.get("num_bits") == 8:
        return QuantConfig("fp8", bits=8, kernel=kernel, skip_modules=skip,
                           explicit_float=True, dynamic_activations=_fp8_activations(w, acts, has))
    if fmt == "pack-quantized" and w.get("type", "int") == "int" and w.get("num_bits") == 4:
        return _int4(w, acts, has, kernel, skip)
    raise QuantizationError(f"compressed-tensors {has} is not supported; {READS}")


def _one_scheme(q: dict) -> tuple[str, dict]:
    groups = q.get("config_groups") or {}
    if len(groups) != 1:
        raise QuantizationError(
            f"compressed-tensors checkpoint with {len(groups)} config_groups "
            f"({', '.join(groups) or 'none'}); {READS}")
    (name, scheme), = groups.items()
    if not isinstance(scheme, dict):
        raise QuantizationError(
            f"compressed-tensors config_groups.{name} is {scheme!r}, a preset name with its "
            "targets rather than a saved scheme; re-save the checkpoint with llm-compressor")
    targets = scheme.get("targets") or []
    if targets != ["Linear"]:
        raise QuantizationError(
            f"compressed-tensors config_groups.{name}.targets is {targets}; {READS} "
            "(targets ['Linear']), its float layers named in ignore")
    return name, scheme


def _refuse_extras(q: dict, name: str, scheme: dict) -> None:
    sparsity = q.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise QuantizationError(
            f"compressed-tensors sparsity_config format {sparsity.get('format')!r} "
            f"({sparsity.get('sparsity_structure')} sparsity, compressed tensors) is not "
            "supported; tpserve reads dense weights")
    if q.get("transform_config"):
        raise QuantizationError(
            "compressed-tensors transform_config (rotations the weights were quantized "
            "under, to be applied while serving) is not supported; tpserve serves the "
            "weights as stored")
    if scheme.get("output_activations"):
        raise QuantizationError(
            f"compressed-tensors config_groups.{name}.output_activations "
            f"{_args(scheme['output_activations'])}: output quantization is not supported; "
            f"{READS}")
    if q.get("kv_cache_scheme"):
        note_once("compressed-tensors kv_cache_scheme %s: its k/v scales are not read; the KV "
              "cache follows --kv-cache-dtype", _args(q["kv_cache_scheme"]))


def _ignore_patterns(ignore: list[str]) -> tuple[str, ...]:
    """compressed-tensors' ignore (exact module names, or "re:" regexes matched at the start
    of the name) as skip_modules "re:" entries: a name becomes an anchored regex."""
    from tpserve.models.loader import text_model_name

    # A vision-language checkpoint served as text names its language model's modules
    # "language_model.model.layers.0..." where tpserve's are "model.layers.0...": both match.
    given, ignore = ignore, [*ignore, *(n for s in ignore if not s.startswith("re:")
                         and (n := text_model_name(s + ".")[:-1]) != s)]
    out = tuple(s if s.startswith("re:") else "re:" + re.escape(s) + "$" for s in ignore)
    for s, raw in zip(out, ignore, strict=True):
        try:
            re.compile(s[3:])
        except re.error as e:
            raise QuantizationError(f"compressed-tensors ignore entry {raw!r} is not a valid "
                                    f"regular expression: {e}") from None
    if not any(re.match(s[3:], "lm_head") for s in out):
        raise QuantizationError(
            f"this compressed-tensors checkpoint quantizes lm_head too (its ignore list "
            f"{given} does not name it); tpserve keeps the LM head in float: use a "
            "checkpoint with a float head")
    return out


def _strategy(a: dict) -> str:
    """The strategy, inferred from group_size where a config omits it (as the library does)."""
    if a.get("strategy"):
        return str(a["strategy"]).lower()
    g = a.get("group_size")
    return "tensor" if g is None else ("channel" if g == -1 else "group")


def _args(a: dict | None, timing: bool = True) -> str:
    """One QuantizationArgs in words, for messages; timing: say whether dynamic."""
    if not a:
        return "none"
    s = _strategy(a)
    what = f"{a.get('type', 'int')} {a.get('num_bits', 8)}-bit, {s}"
    if s == "group":
        what += f" {a.get('group_size')}"
    if a.get("block_structure"):
        what += f" {a['block_structure']}"
    if not a.get("symmetric", True):
        what += ", asymmetric"
    if timing:
        what += ", dynamic" if a.get("dynamic") else ", static"
    return what


def _fp8_activations(w: dict, acts: dict | None, has: str) -> bool:
    """Whether fp8 layers may round activations to e4m3 per row (Fp8Method's W8A8)."""
    if _strategy(w) not in ("tensor", "channel") or not w.get("symmetric", True):
        raise QuantizationError(f"compressed-tensors {has}: fp8 weights need tensor or "
                                f"channel scales, symmetric; {READS}")
    if acts is None:
        return False
    if acts.get("type") != "float" or acts.get("num_bits") != 8:
        raise QuantizationError(f"compressed-tensors {has}: activation quantization other "
                                f"than fp8 is not supported; {READS}")
    if acts.get("dynamic") is True and _strategy(acts) in ("token", "tensor"):
        return True  # per row is what W8A8 does; for per tensor it is the finer choice
    if acts.get("dynamic") is False and _strategy(acts) == "tensor":
        note_once("compressed-tensors static fp8 activation scales (input_scale) are not "
              "applied: its fp8 layers run weight-only, activations in the model dtype")
        return False
    raise QuantizationError(f"compressed-tensors {has}: fp8 activations must be dynamic per "
                            f"token or per tensor, or static per tensor; {READS}")


def _int4(w: dict, acts: dict | None, has: str, kernel: str,
          skip: tuple[str, ...]) -> QuantConfig:
    strategy = _strategy(w)
    if strategy not in ("group", "channel"):
        raise QuantizationError(f"compressed-tensors {has}: 4-bit weights need group or "
                                f"channel scales; {READS}")
    if str(w.get("actorder")).lower() in ("group", "dynamic", "true"):
        raise QuantizationError(
            f"compressed-tensors {has} with actorder {w.get('actorder')!r} (a weight_g_idx "
            "per layer) is not supported; tpserve reads actorder null, 'weight' or 'static'")
    if acts is not None:
        raise QuantizationError(f"compressed-tensors {has}: 4-bit weights with quantized "
                                f"activations are not supported; {READS}")
    group = int(w["group_size"]) if strategy == "group" else -1
    return QuantConfig("compressed-tensors", bits=4, group_size=group,
                       sym=bool(w.get("symmetric", True)), zero_offset=0, kernel=kernel,
                       skip_modules=skip, explicit_float=True)


_NOTED: set[str] = set()


def note_once(msg: str, *args) -> None:
    """Log once per process what a checkpoint holds that tpserve does not apply (the config
    is resolved by the launcher and again by every shard)."""
    if msg not in _NOTED:
        _NOTED.add(msg)
        log.warning(msg, *args)
