"""An out-of-tree attention backend for tpserve, registered under the entry-point group
"tpserve.kernels" as "example" (see pyproject.toml).

It keeps its KV cache in a layout of its own, [num_blocks, kv_heads, block_size, head_dim]
(head-major, as SYCL and CUDA paged kernels often want), writes it itself, and computes
attention with tpserve's portable reference over a transposed view. A real plugin replaces
prefill/decode with calls into its compiled kernels (a SYCL or CUDA extension) and keeps
the rest of this file as it is.
"""

from __future__ import annotations

import torch

from tpserve.kernels.base import AttentionBackend, AttentionSpec
from tpserve.kernels.capabilities import unknown_feature_reason
from tpserve.kernels.torch_backend import TorchAttentionBackend


class ExampleBackend(AttentionBackend):
    name = "example"

    def __init__(self) -> None:
        self._reference = TorchAttentionBackend()
        self.steps = 0  # lets tests see that serving went through this backend

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, spec: AttentionSpec) -> str | None:
        if device.type != "cpu":
            return f"the example backend runs on the CPU only, not {device.type}"
        if spec.num_heads % spec.num_kv_heads:
            return f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
        return unknown_feature_reason(spec)

    def kv_cache_shape(self, num_blocks: int, spec: AttentionSpec) -> tuple[int, ...]:
        return (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        block_size = k_cache.shape[2]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        # Advanced indices on dims 0 and 2 around a slice: the result is [T, kv_heads, dim].
        k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v.to(v_cache.dtype)

    @staticmethod
    def _standard(cache: torch.Tensor) -> torch.Tensor:
        # [blocks, heads, block, dim] viewed as the reference's [blocks, block, heads, dim].
        return cache.transpose(1, 2)

    def prefill(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None):
        self.steps += 1
        return self._reference.prefill(q, self._standard(k_cache), self._standard(v_cache),
                                       meta, spec, alibi_slopes)

    def decode(self, q, k_cache, v_cache, meta, spec, alibi_slopes=None):
        self.steps += 1
        return self._reference.decode(q, self._standard(k_cache), self._standard(v_cache),
                                      meta, spec, alibi_slopes)
