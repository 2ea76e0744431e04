"""What the engine tells its front ends about the served model (GET /info, request limits).

Kept on the engine side, free of HTTP imports, so engine code never imports tpserve.server.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelInfo:
    """What GET /info reports, and the limits validation enforces."""

    model_id: str
    model_dtype: str
    model_device_type: str
    tp_size: int
    max_input_tokens: int
    max_total_tokens: int
    max_concurrent_requests: int
    max_stop_sequences: int = 8
    max_top_n_tokens: int = 5
    max_batch_total_tokens: int | None = None
    attention_backend: str = "torch"
    # The prompt feeds an encoder (T5): nothing scores its tokens.
    encoder_decoder: bool = False
    version: str = "0.1.0"
    # LoRA adapters served next to the base model (--lora-modules names), in launch order.
    adapters: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
