"""Tiny GPTQ, AWQ, fp8 and compressed-tensors checkpoints written from a float model in the
test itself (no quantization library): each linear weight of the decoder layers is quantized
here, packed as the format stores it, and the dequantized float weights go into a twin
checkpoint that transformers runs as the oracle. The packing below is written from the
formats' published layouts, independently of tpserve/layers/quant/packing.py and
tpserve/layers/quant/compressed_tensors.py (test_quant_compressed_tensors.py checks the
compressed-tensors writer against that library where it is installed)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2)
# Phi-3 stores qkv_proj and gate_up_proj fused on disk; w1, w3, w2: Mixtral's experts' gate,
# up and down (Qwen MoE experts and shared experts use the dense names). Routers (mlp.gate,
# block_sparse_moe.gate, shared_expert_gate) stay float, as the released checkpoints keep them.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "qkv_proj", "gate_up_proj", "w1", "w2", "w3",
           # Bloom and GPT-NeoX (query_key_value per head), Phi-1/2 (dense, fc1, fc2),
           # GPTBigCode (c_attn fused [q; k; v] or per head, c_proj, c_fc), Falcon
           "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "fc1", "fc2",
           "c_attn", "c_proj", "c_fc",
           # DeepSeek's MLA (q_proj, o_proj above; the routers, mlp.gate, stay float)
           "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
# The LayerNorm families at 128 wide: 4 heads of 32 (GPTBigCode: one KV head of 32, read
# whole by every rank; Phi: 2 KV heads), MLPs of 256, so groups of 32 stay whole at tp = 4.
# Bloom stays 64 wide (at 128 its random continuations loop on a token or two): its
# attention dense then has 16 input features a rank at tp = 4, which only act-order GPTQ
# (every group's scales on every rank) or fp8 (no groups) serves.
LAYERNORM_SHAPES = {
    "bloom": {},
    "gpt-neox": dict(hidden_size=128, intermediate_size=256),
    "phi": dict(hidden_size=128, intermediate_size=256),
    "gpt-bigcode": dict(n_embd=128, n_inner=256),
    "gpt-bigcode-mha": dict(n_embd=128, n_inner=256, multi_query=False),
    # Falcon's query_key_value grouped by KV head: 40B's 2 groups of [q, q, k, v], 7B's
    # multi-query [q; k; v]
    "falcon-40b": dict(hidden_size=128, ffn_hidden_size=256),
    "falcon": dict(hidden_size=128, ffn_hidden_size=256),
    # Cohere (q/k rows reordered within each head at load, packed int4 ones too) and Cohere
    # 2 (its sliding layers, one full layer without positions, q/k/v/o biases).
    "cohere": dict(hidden_size=128, intermediate_size=256),
    "cohere-qk-norm": dict(hidden_size=128, intermediate_size=256),
    "cohere2": dict(hidden_size=128, intermediate_size=256),
}

# Mixture-of-experts models: 128 wide (4 heads of 32, 2 KV heads), experts of 128 (32 a rank
# at tp = 4: whole groups of 32), dense layers and Qwen2-MoE's shared expert of 256.
MOE_SHAPES = {
    "mixtral": dict(hidden_size=128, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2),
    "qwen3-moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen2-moe": dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                      shared_expert_intermediate_size=256, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32),
}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # packed column c, nibble i holds column 8c + AWQ_ORDER[i]


def _to_int32(v: torch.Tensor) -> torch.Tensor:
    v = v.to(torch.int64) & 0xFFFFFFFF
    return torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)


def pack_along_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] nibbles -> [K / 8, N]: row 8r + i in bits 4i of row r (GPTQ qweight)."""
    out = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.int64)
    for r in range(out.shape[0]):
        for i in range(8):
            out[r] += q[8 * r + i].to(torch.int64) * (16**i)
    return _to_int32(out)


def pack_along_cols(q: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, N] nibbles -> [R, N / 8]: packed column c, nibble i = column 8c + order[i]."""
    out = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for c in range(out.shape[1]):
        for i in range(8):
            out[:, c] += q[:, 8 * c + order[i]].to(torch.int64) * (16**i)
    return _to_int32(out)


def quantize_int4(w: torch.Tensor, group: int, sym: bool, act_order: bool, seed: int,
                  scale_dtype: torch.dtype = torch.float16):
    """w [N, K] -> (q [K, N], zeros [G, N], scales [G, N] in scale_dtype, g_idx [K],
    dequant [N, K]). act_order: the groups are formed over a random permutation of the input
    rows, as GPTQ's desc_act does, so g_idx is not sorted. q and zeros are 0..15; symmetric
    means zero 8 and scale max|w| / 7.5 (q - 8 in -8..7, as compressed-tensors has it too)."""
    wt = w.t().contiguous().float()
    k, n = wt.shape
    ngroups = k // group
    if act_order:
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[perm] = (torch.arange(k) // group).to(torch.int32)
    else:
        g_idx = (torch.arange(k) // group).to(torch.int32)
    scales = torch.empty(ngroups, n)
    zeros = torch.empty(ngroups, n, dtype=torch.int64)
    for j in range(ngroups):
        block = wt[g_idx == j]
        if sym:
            amax = block.abs().amax(0).clamp(min=1e-8)
            scales[j], zeros[j] = 2 * amax / 15, 8
        else:
            lo, hi = block.amin(0).clamp(max=0), block.amax(0).clamp(min=0)
            scales[j] = ((hi - lo) / 15).clamp(min=1e-8)
            zeros[j] = torch.round(-lo / scales[j]).clamp(1, 15).long()
    scales = scales.to(scale_dtype).float()  # what the checkpoint stores
    g = g_idx.long()
    q = (torch.round(wt / scales[g]) + zeros[g]).clamp(0, 15).long()
    deq = ((q - zeros[g]).float() * scales[g]).t().contiguous()
    return q, zeros, scales.to(scale_dtype), g_idx, deq


def float_checkpoint(models_dir: Path, family: str) -> Path:
    """The float model (llama, qwen2 with perturbed biases and norms, or phi3) of SHAPE that
    the quantized checkpoints are written from, saved once per session; or a mixture of
    experts (mixtral, qwen3-moe, qwen2-moe) of MOE_SHAPES, with tiny_models' weights."""
    from tiny_models import FAMILY_CHECKPOINTS, llama_config, phi3_config, qwen2_config, save_model

    out = models_dir / f"quant-float-{family}"
    if not (out / "config.json").exists():
        if family in MOE_SHAPES or family in LAYERNORM_SHAPES:
            config, kwargs = FAMILY_CHECKPOINTS[family]
            shape = MOE_SHAPES.get(family) or LAYERNORM_SHAPES[family]
            if family == "gpt-bigcode-mha":  # FAMILY_CHECKPOINTS' entry takes no arguments
                from tiny_models import gpt_bigcode_config as config
            if family == "cohere-qk-norm":  # likewise
                from tiny_models import cohere_config

                def config(**kw):
                    return cohere_config(use_qk_norm=True, **kw)
            save_model(config(**shape), out, **kwargs)
            return out
        config = {"llama": llama_config, "qwen2": qwen2_config, "phi3": phi3_config}[family](
            **SHAPE)
        save_model(config, out, vector_std=0.1 if family == "qwen2" else 0.0)
    return out


_REFERENCES: dict[str, tuple] = {}


def quantized_with_reference(models_dir: Path, name: str, family: str, kwargs: dict) -> tuple:
    """(quantized dir, transformers' greedy 32-token continuations of PROMPTS, its last
    prefill logits), both from the dequantized twin: write_quantized(**kwargs) of family's
    float model under name, built once per session."""
    from tiny_models import PROMPTS, hf_greedy, hf_last_logits

    if name not in _REFERENCES:
        src = float_checkpoint(models_dir, family)
        qdir, ref = write_quantized(src, models_dir / name, models_dir / f"{name}-ref",
                                    **kwargs)
        _REFERENCES[name] = (qdir, hf_greedy(ref, PROMPTS, 32), hf_last_logits(ref, PROMPTS))
    return _REFERENCES[name]


def _linear_names(weights: dict) -> list[str]:
    return [name[: -len(".weight")] for name in weights
            if name.endswith(".weight") and any(f".{p}." in name + "." for p in LINEARS)]


def _input_seed(name: str) -> int:
    """One act-order permutation per layer input: GPTQ orders rows by the Hessian of the
    input, which q/k/v (and gate/up) share, so their g_idx are equal."""
    for a, b in (("k_proj", "q_proj"), ("v_proj", "q_proj"), ("up_proj", "gate_proj"),
                 ("w3", "w1")):
        name = name.replace(a, b)
    return sum(map(ord, name)) * 7919 + len(name)


def write_quantized(float_dir: Path, out: Path, ref_out: Path, fmt: str, group: int = 32,
                    sym: bool = True, act_order: bool = False, fp8_per_tensor: bool = False,
                    fp8_block: tuple[int, int] | None = None,
                    ignore: tuple[str, ...] = ("lm_head",),
                    not_convert: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """From float_dir write out/ (fmt: gptq | awq | fp8, or compressed-tensors' ct-w4a16
    (group -1: channel) | ct-fp8 (static activations) | ct-fp8-dynamic) and ref_out/ (its
    dequantized float weights, no quantization_config). Returns (out, ref_out).
    fp8_block = (rows, columns): block scales as the official FP8 releases store them
    (weight_scale_inv, weight_block_size). ignore: compressed-tensors' list of modules kept
    float (names, or "re:" regexes). not_convert: GPTQ's and AWQ's modules_to_not_convert
    (name fragments)."""
    weights = load_file(float_dir / "model.safetensors")
    quant, ref = dict(weights), dict(weights)
    for name in _linear_names(weights):
        if fmt.startswith("ct-") and _ct_ignored(name, ignore) or \
                any(s in name for s in not_convert):
            continue
        w = weights[f"{name}.weight"]
        del quant[f"{name}.weight"]
        if fmt == "fp8" and fp8_block:
            deq = _write_fp8_blocks(quant, name, w, fp8_block)
        elif fmt == "fp8":
            deq = _write_fp8(quant, name, w, fp8_per_tensor)
        elif fmt.startswith("ct-"):
            deq = _write_ct(quant, name, w, fmt, group, sym)
        else:
            q, zeros, scales, g_idx, deq = quantize_int4(w, group, sym, act_order,
                                                         seed=_input_seed(name))
            quant[f"{name}.scales"] = scales
            if fmt == "gptq":
                quant[f"{name}.qweight"] = pack_along_rows(q)
                quant[f"{name}.qzeros"] = pack_along_cols(zeros - 1)  # v1 stores zero - 1
                quant[f"{name}.g_idx"] = g_idx
            else:
                quant[f"{name}.qweight"] = pack_along_cols(q, AWQ_ORDER)
                quant[f"{name}.qzeros"] = pack_along_cols(zeros, AWQ_ORDER)
        ref[f"{name}.weight"] = deq
    config = json.loads((float_dir / "config.json").read_text())
    qcfg = ct_quantization_config(fmt, group, sym, ignore) if fmt.startswith("ct-") else {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
                 "sym": sym, "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                "version": "gemm"},
        "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"}}[fmt]
    if not_convert:
        qcfg["modules_to_not_convert"] = list(not_convert)
    if fp8_block:  # as Qwen/Qwen3-8B-FP8's config.json has it
        qcfg = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(fp8_block)}
    for d, tensors, cfg in ((out, quant, {**config, "quantization_config": qcfg}),
                            (ref_out, ref, config)):
        shutil.copytree(float_dir, d, dirs_exist_ok=True)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return out, ref_out


def _write_fp8(quant: dict, name: str, w: torch.Tensor, per_tensor: bool) -> torch.Tensor:
    w = w.float()
    amax = w.abs().amax() if per_tensor else w.abs().amax(dim=1, keepdim=True)
    scale = (amax / 448.0).clamp(min=1e-12)
    q = (w / scale).to(torch.float8_e4m3fn)
    quant[f"{name}.weight"] = q
    quant[f"{name}.weight_scale"] = scale.reshape(()) if per_tensor else scale.float()
    quant[f"{name}.input_scale"] = torch.tensor(1.0)  # unused by weight-only serving
    return q.float() * scale


def _block_index(n: int, k: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For each weight row and column, the row and column of its block's scale."""
    return torch.arange(n) // block[0], torch.arange(k) // block[1]


def _write_fp8_blocks(quant: dict, name: str, w: torch.Tensor,
                      block: tuple[int, int]) -> torch.Tensor:
    """weight (e4m3) and weight_scale_inv (float32, one per block; the last blocks cut by N
    and K), where weight * scale_inv of its block is the float weight. Each block's scale is
    its largest magnitude / 448 times 2^0..2^4 (seeded by the name), so neighbouring blocks'
    scales differ by up to 16x and a reader that takes one scale per row or per tensor is far
    off."""
    w = w.float()
    (n, k), (bn, bk) = w.shape, block
    rows, cols = _block_index(n, k, block)
    grid = (-(-n // bn), -(-k // bk))
    padded = torch.zeros(grid[0] * bn, grid[1] * bk)
    padded[:n, :k] = w.abs()
    amax = padded.view(grid[0], bn, grid[1], bk).amax(dim=(1, 3))
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    scale = (amax / 448.0).clamp(min=1e-12) * 2.0 ** torch.randint(0, 5, grid, generator=g)
    per_weight = scale[rows][:, cols]
    q = (w / per_weight).to(torch.float8_e4m3fn)
    quant[f"{name}.weight"] = q
    quant[f"{name}.weight_scale_inv"] = scale.float()
    return q.float() * per_weight


def write_fp8_block_misread(qdir: Path, ref_out: Path, how: str) -> Path:
    """A float checkpoint from the block-scaled qdir dequantized the wrong way, for oracle
    guards: how = "row" takes each row's first block scale for the whole row, "tensor" the
    first scale for the whole tensor."""
    config = json.loads((qdir / "config.json").read_text())
    block = config.pop("quantization_config")["weight_block_size"]
    weights = load_file(qdir / "model.safetensors")
    for name in [n for n in weights if n.endswith(".weight_scale_inv")]:
        base = name[: -len("_scale_inv")]
        q, scale = weights.pop(base).float(), weights.pop(name)
        rows, _ = _block_index(*q.shape, block)
        weights[base] = q * (scale[rows, :1] if how == "row" else scale[0, 0])
    shutil.copytree(qdir, ref_out, dirs_exist_ok=True)
    save_file(weights, ref_out / "model.safetensors", metadata={"format": "pt"})
    (ref_out / "config.json").write_text(json.dumps(config, indent=2))
    return ref_out


EXPERT_TENSOR = re.compile(r"(.*\.experts\.)(\d+)(\.\w+\.)(scales|qzeros|weight_scale|"
                           r"weight_scale_inv|weight_zero_point)$")


def write_expert_scales_from(qdir: Path, out: Path, expert: int = 0) -> Path:
    """A copy of the quantized qdir whose every expert carries `expert`'s scales (and zero
    points): what a loader that read one expert's scales for all would serve, for oracle
    guards."""
    weights = load_file(qdir / "model.safetensors")
    for name in list(weights):
        if (m := EXPERT_TENSOR.match(name)) and int(m[2]) != expert:
            weights[name] = weights[f"{m[1]}{expert}{m[3]}{m[4]}"].clone()
    shutil.copytree(qdir, out, dirs_exist_ok=True)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def write_fp8_cast_reference(float_dir: Path, ref_out: Path, tp: int) -> Path:
    """Oracle for --quantize fp8 on float_dir at this tp: tpserve scales each output channel
    of the slice a rank holds, so row-parallel weights (o_proj, down_proj) get tp scales per
    row, one per column block."""
    weights = load_file(float_dir / "model.safetensors")
    for name in _linear_names(weights):
        w = weights[f"{name}.weight"].float()
        blocks = w.chunk(tp, dim=1) if name.endswith(("o_proj", "down_proj")) else [w]
        deq = []
        for b in blocks:
            scale = (b.abs().amax(dim=1, keepdim=True) / 448.0).clamp(min=1e-12)
            deq.append((b / scale).to(torch.float8_e4m3fn).float() * scale)
        weights[f"{name}.weight"] = torch.cat(deq, dim=1)
    shutil.copytree(float_dir, ref_out, dirs_exist_ok=True)
    save_file(weights, ref_out / "model.safetensors", metadata={"format": "pt"})
    return ref_out


# compressed-tensors (llm-compressor's format), from its published schema: one scheme in
# config_groups targeting every Linear, the float modules in ignore.
def ct_weights(fmt: str, group: int = 32, sym: bool = True) -> dict:
    """config_groups.*.weights as llm-compressor writes them for fmt (write_quantized's)."""
    if fmt == "ct-w4a16":
        return {"num_bits": 4, "type": "int", "symmetric": sym, "dynamic": False,
                "group_size": group if group > 0 else None,
                "strategy": "group" if group > 0 else "channel", "actorder": None,
                "observer": "minmax", "observer_kwargs": {}}
    return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
            "group_size": None, "strategy": "tensor" if fmt == "ct-fp8" else "channel",
            "observer": "minmax", "observer_kwargs": {}}


def ct_activations(fmt: str) -> dict | None:
    if fmt == "ct-fp8":  # the FP8 preset: static per-tensor scales (input_scale)
        return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                "group_size": None, "strategy": "tensor", "observer": "static_minmax"}
    if fmt == "ct-fp8-dynamic":  # FP8_DYNAMIC: per token, computed while serving
        return {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
                "group_size": None, "strategy": "token"}
    return None


def ct_quantization_config(fmt: str, group: int = 32, sym: bool = True,
                           ignore: tuple[str, ...] = ("lm_head",)) -> dict:
    scheme = {"targets": ["Linear"], "weights": ct_weights(fmt, group, sym),
              "input_activations": ct_activations(fmt), "output_activations": None,
              "format": None}
    return {"config_groups": {"group_0": scheme},
            "format": "pack-quantized" if fmt == "ct-w4a16" else "float-quantized",
            "global_compression_ratio": None, "ignore": list(ignore), "kv_cache_scheme": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed",
            "sparsity_config": {}, "transform_config": {}, "version": "0.20.1"}


def _ct_ignored(name: str, ignore) -> bool:
    return any(re.match(p[3:], name) if p.startswith("re:") else p == name for p in ignore)


def _write_ct(quant: dict, name: str, w: torch.Tensor, fmt: str, group: int,
              sym: bool) -> torch.Tensor:
    """One linear in compressed-tensors' tensors; returns the dequantized weight [N, K]."""
    if fmt != "ct-w4a16":
        deq = _write_fp8(quant, name, w, per_tensor=fmt == "ct-fp8")
        quant[f"{name}.weight_scale"] = quant[f"{name}.weight_scale"].reshape(-1, 1) \
            if fmt != "ct-fp8" else quant[f"{name}.weight_scale"].reshape(1)
        if fmt == "ct-fp8":
            quant[f"{name}.input_scale"] = torch.tensor([0.05])  # calibrated; not applied
        else:
            del quant[f"{name}.input_scale"]
        return deq
    # Group along K (channel: one group of the whole row); scales in the model's dtype as
    # llm-compressor keeps them, bfloat16 here (exact in the float32 oracle).
    g = group if group > 0 else w.shape[1]
    q, zeros, scales, _, deq = quantize_int4(w, g, sym, False, seed=0,
                                             scale_dtype=torch.bfloat16)
    quant[f"{name}.weight_packed"] = pack_along_cols(q.t())  # [N, K/8]: input 8w + i, nibble i
    quant[f"{name}.weight_scale"] = scales.t().contiguous()  # [N, G]
    quant[f"{name}.weight_shape"] = torch.tensor(list(w.shape))
    if not sym:  # [N/8, G]: output 8r + i in nibble i of row r; stored zero + 8 = zeros here
        quant[f"{name}.weight_zero_point"] = pack_along_rows(zeros.t())
    return deq


def unreordered_rows(what: str):
    """half_order_rows (the q/k reorder for an interleaved rotary) skipping the tensors
    `what` names: "quantized", every int4 tensor; "zeros", only the packed zero points. The
    plausible mistakes, for oracle guards."""
    from tpserve.layers.interleaved_rotary import half_order_rows

    def rows(w, head_dim, method):
        tensor = w.name.rpartition(".")[2]
        skip = ("qzeros", "weight_zero_point") if what == "zeros" else \
            ("qweight", "scales", "qzeros", "weight_packed", "weight_scale", "weight_zero_point")
        return w if tensor in skip else half_order_rows(w, head_dim, method)
    return rows
