"""Phi-3: Llama-shaped, but its checkpoints store q, k, v fused as qkv_proj ([q; k; v] rows)
and gate, up fused as gate_up_proj ([gate; up] rows). Both load through the fused-on-disk
path of QKVParallelLinear / MergedColumnParallelLinear (shard_id None), which takes each
part's slice for this rank. The sliding window, when set, covers every layer."""

from __future__ import annotations

from tpserve.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # Checkpoint names already match the fused parameters: nothing to stack.
    stacked_params: list = []
    reads_partial_rotary = True

    @staticmethod
    def model_kwargs(config) -> dict:
        # A refusal to shard names qkv_proj / gate_up_proj, the tensors the file holds.
        return {**LlamaForCausalLM.model_kwargs(config), "fused_on_disk": True}
