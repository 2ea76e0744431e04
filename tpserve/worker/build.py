"""Building a shard's model: the right class with this rank's parameter shapes, random
weights for --load-format dummy, and the early sharding check on the meta device."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from tpserve.config import EngineConfig
from tpserve.models.registry import model_class


@contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def build_model(cfg: EngineConfig, hf_config, device: torch.device):
    """The model class for this checkpoint with this rank's parameter shapes (uninitialised).
    On the meta device this costs nothing, which is how the driver checks sharding early."""
    cls = model_class(hf_config)
    with torch.device(device), default_dtype(getattr(torch, cfg.model.dtype)):
        return cls(hf_config, max_positions=cfg.model.max_model_len)


@torch.no_grad()
def fill_dummy(model: torch.nn.Module, seed: int) -> None:
    """Small random weights (norm weights 1) so activations stay finite at any depth."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.fill_(0.0 if name.endswith("bias") else 1.0)
            continue
        g = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        p.uniform_(-0.02, 0.02, generator=g)


def check_shardable(cfg: EngineConfig, hf_config) -> None:
    """Build every rank's model on the meta device: a tp the checkpoint cannot take fails
    here, before any actor starts, with the tensor and the rule in the message."""
    from tpserve.distributed import tp_context

    for rank in range(cfg.parallel.tp_size):
        with tp_context(rank, cfg.parallel.tp_size):
            build_model(cfg, hf_config, torch.device("meta"))
