"""The attention-backend interface: what every kernel (portable, Triton, IPEX, plugin) implements.

Layout of the paged KV cache is the backend's choice (kv_cache_shape); the engine only
deals in block ids and slots (slot = block_id * block_size + offset).

Encoder-decoder models (T5) add three things, each flagged in AttentionSpec so a backend
that lacks one refuses the spec through supports() (check spec.features):
- "non_causal" (spec.causal=False): every query sees all seq_lens[i] keys of its sequence.
  Cross attention is paged attention of this kind over the encoder output's K/V.
- "relative_bias" (spec.relative_bias): a bias table by relative position is passed as
  rel_bias to forward/prefill/decode/attend_dense; see RelBias.
- "dense" (spec.paged=False): no cache at all; attend_dense() over this step's own K/V,
  sequences laid out varlen by query_start_loc (an encoder's self-attention).

Attention sinks (gpt-oss; spec.sinks, feature "sinks"): a learned logit per query head that
joins each softmax denominator and attends to nothing, so a query's weights over its keys sum
to less than one. The float32 [num_heads on this rank] logits are passed as sinks= (a
keyword, only for such specs) to forward/prefill/decode/decode_new.

Chunked attention (Llama 4's RoPE layers; spec.attention_chunk, feature "chunked"): positions
fall in chunks of attention_chunk (0..c-1, c..2c-1, ...), and a query sees only the keys of
its own chunk (causal within it). The cache keeps every block: the same model's full-attention
layers read the whole context anyway.

An fp8 KV cache (spec.kv_cache_dtype == "fp8", feature "fp8_kv_cache") stores e4m3fn values
with the per-tensor scales spec.k_scale / spec.v_scale (kernels/kv_quant.py); write_kv and
rotary_write_kv then receive the spec as a keyword. Only backends that set fp8_kv_cache =
True are offered such a spec (registry.why_not), and their supports() still decides.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tpserve.kernels import kv_quant
from tpserve.kernels.fused_ops import apply_rotary_torch

# rel_bias: float [num_heads on this rank, 2 * R + 1]. The score of query position qp and key
# position kp in head h gains rel_bias[h, R + clamp(kp - qp, -R, R)]; R = (columns - 1) // 2.
# Positions are those of the sequence (paged: query i of a chunk of n sits at
# seq_len - n + i; dense: 0..len-1), the same convention the causal mask uses. The T5 buckets
# saturate at max_distance, so R = max_distance makes the table exact.
RelBias = torch.Tensor


@dataclass(frozen=True)
class AttentionSpec:
    """Static description of one attention layer on one rank."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (after replication when tp > kv heads)
    head_dim: int
    scale: float
    sliding_window: int | None = None  # a query sees keys with q_pos - window < k_pos <= q_pos
    alibi: bool = False  # per-head slopes passed to forward()
    softcap: float | None = None  # scores = softcap * tanh(scores / softcap)
    block_size: int = 16
    causal: bool = True  # False: each query sees every key of its sequence (cross, encoder)
    relative_bias: bool = False  # a rel_bias table is passed (T5's bucketed position bias)
    paged: bool = True  # False: no KV cache; attend_dense() on the step's own K/V
    # "auto": the cache holds the model dtype; "fp8": float8_e4m3fn, read as stored * scale.
    kv_cache_dtype: str = "auto"
    k_scale: float = 1.0  # per-tensor scales of an fp8 cache (1.0 until a checkpoint has one)
    v_scale: float = 1.0
    sinks: bool = False  # a sinks= logit per head joins the softmax denominator
    # A query at position p sees only keys k with k // chunk == p // chunk (Llama 4).
    attention_chunk: int | None = None

    @property
    def features(self) -> frozenset[str]:
        f = {"prefill", "decode"} if self.paged else {"dense"}
        if not self.causal:
            f.add("non_causal")
        if self.relative_bias:
            f.add("relative_bias")
        if self.sliding_window:
            f.add("sliding_window")
        if self.alibi:
            f.add("alibi")
        if self.softcap:
            f.add("softcap")
        if self.kv_cache_dtype == "fp8":
            f.add(kv_quant.FP8_FEATURE)
        if self.sinks:
            f.add("sinks")
        if self.attention_chunk:
            f.add("chunked")
        return frozenset(f)


@dataclass
class AttentionMetadata:
    """Per-step batch layout (tensors on the worker's device). Sequences are laid out
    contiguously in the flat token dimension in the order of seq_lens."""

    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [B], context length after this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks]; unused entries hold any valid id
    slot_mapping: torch.Tensor  # int64 [T], cache slot for each new token
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends can plan without a device sync.
    query_lens_host: tuple[int, ...] = ()
    seq_lens_host: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """One implementation of paged attention. Instances are per worker, stateless per step."""

    name: str = "abstract"
    # True: write_kv / prefill / decode handle an fp8 cache (spec.kv_cache_dtype == "fp8").
    fp8_kv_cache: bool = False

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, spec: AttentionSpec) -> str | None:
        """None when this backend can run `spec` here, else the reason it cannot."""

    def kv_cache_shape(self, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        return (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        spec: AttentionSpec | None = None,
    ) -> None:
        """Store this step's keys/values ([T, kv_heads, head_dim]) at their slots. spec is
        passed (as a keyword) for an fp8 cache only: its k_scale / v_scale quantize."""
        if kv_quant.is_fp8(k_cache):
            k = kv_quant.quantize(k, spec.k_scale if spec else 1.0)
            v = kv_quant.quantize(v, spec.v_scale if spec else 1.0)
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)

    def rotary_write_kv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        spec: AttentionSpec | None = None,
    ) -> torch.Tensor:
        """Rotate q and k by the step's rotary cos/sin ([T, rot_dim], in q's dtype), store the
        rotated keys and the values (write_kv), return the rotated q. Backends with a fused
        kernel override this; the default is the torch reference. spec: as in write_kv."""
        extra = {} if spec is None else {"spec": spec}
        self.write_kv(apply_rotary_torch(k, cos, sin), v, k_cache, v_cache, slot_mapping,
                      **extra)
        return apply_rotary_torch(q, cos, sin)

    def write_new(self, q, k, v, rope, k_cache, v_cache, slot_mapping,
                  spec: AttentionSpec) -> torch.Tensor:
        """Store a step's new keys and values (rotated by rope = (cos, sin) when given, as
        rotary_write_kv does) and return q, rotated likewise."""
        # The spec reaches the write only for an fp8 cache (its scales), so backends without
        # one keep their write_kv signature.
        extra = {"spec": spec} if spec.kv_cache_dtype != "auto" else {}
        if rope is None:
            self.write_kv(k, v, k_cache, v_cache, slot_mapping, **extra)
            return q
        return self.rotary_write_kv(q, k, v, *rope, k_cache, v_cache, slot_mapping, **extra)

    def decode_new(self, q, k, v, rope, k_cache, v_cache, meta: AttentionMetadata,
                   spec: AttentionSpec, alibi_slopes=None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A decode step (one new token per sequence) from its raw projections: q [B, heads,
        head_dim] and k/v [B, kv_heads, head_dim], rotated by rope = (cos, sin) ([B,
        rot_dim]) when given, the keys and values stored at meta.slot_mapping. The default
        stores (write_new) and then attends (forward); a backend with a kernel that does
        all of it in one launch overrides this. sinks: given (as a keyword) for a spec with
        sinks only."""
        q = self.write_new(q, k, v, rope, k_cache, v_cache, meta.slot_mapping, spec)
        extra = {} if sinks is None else {"sinks": sinks}
        return self.forward(q, k_cache, v_cache, meta, spec, alibi_slopes, **extra)

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        alibi_slopes: torch.Tensor | None = None,
        rel_bias: RelBias | None = None,
    ) -> torch.Tensor:
        """Attention for a batch where some sequences bring several new tokens (prompt
        chunks, possibly mixed with decodes). q: [T, heads, head_dim] -> same shape. The new
        tokens' K/V are already in the cache; each attends to its own sequence's context.
        rel_bias is passed only for specs with relative_bias (as a keyword)."""

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        alibi_slopes: torch.Tensor | None = None,
        rel_bias: RelBias | None = None,
    ) -> torch.Tensor:
        """Attention for a batch of one new token per sequence. q: [B, heads, head_dim]."""

    def forward(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None,
                rel_bias: RelBias | None = None, sinks: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Dispatch to decode or prefill. rel_bias (only when spec.relative_bias) and sinks
        (only when spec.sinks) reach them as keywords, so a backend without either keeps its
        signature."""
        extra = {} if rel_bias is None else {"rel_bias": rel_bias}
        if sinks is not None:
            extra["sinks"] = sinks
        if meta.decode_only:
            return self.decode(q, k_cache, v_cache, meta, spec, alibi_slopes, **extra)
        return self.prefill(q, k_cache, v_cache, meta, spec, alibi_slopes, **extra)

    def attend_dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        rel_bias: RelBias | None = None,
    ) -> torch.Tensor:
        """Attention with no cache (spec.paged=False, feature "dense"), e.g. an encoder.
        q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim], sequences laid out by
        meta.query_start_loc; each token attends to its own sequence's tokens only (all of
        them when not spec.causal). Returns [T, heads, head_dim]. meta.seq_lens equals the
        query lengths; block_tables and slot_mapping are not read here."""
        raise NotImplementedError(f"attention backend {self.name!r} has no dense attention")

    def warmup(self, device: torch.device, dtype: torch.dtype, spec: AttentionSpec,
               batch_sizes: tuple[int, ...] = (1,)) -> None:
        """Compile whatever this backend compiles, before serving. Default: nothing to do."""
