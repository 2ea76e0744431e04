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
    from tpserve.layers.quant.config import quant_context, resolve_quant

    cls = model_class(hf_config)
    quant = resolve_quant(cfg.model.quantize, hf_config, cfg.model.quant_kernel)
    with torch.device(device), default_dtype(getattr(torch, cfg.model.dtype)), \
            quant_context(quant):
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
        if p.dtype in (torch.int32, torch.int64):  # packed int4: any bits are valid nibbles
            p.random_(generator=g)
        elif p.element_size() == 1:  # fp8: no uniform_ of its own
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(-0.02, 0.02, generator=g))
        else:
            p.uniform_(-0.02, 0.02, generator=g)


def check_shardable(cfg: EngineConfig, hf_config) -> None:
    """Build every rank's model on the meta device: a tp the checkpoint cannot take fails
    here, before any actor starts, with the tensor and the rule in the message."""
    from tpserve.distributed import tp_context
    from tpserve.errors import ShardingError

    try:
        for rank in range(cfg.parallel.tp_size):
            with tp_context(rank, cfg.parallel.tp_size):
                build_model(cfg, hf_config, torch.device("meta"))
    except ShardingError as err:
        works = tps_that_shard(cfg, hf_config)
        if not works:
            raise
        listed = works[0] if len(works) == 1 else f"{', '.join(works[:-1])} or {works[-1]}"
        raise ShardingError(f"{err} The whole model shards at tp = {listed} (tp 1 to "
                            f"{MAX_TP_LISTED} checked).") from err


MAX_TP_LISTED = 16


def tps_that_shard(cfg: EngineConfig, hf_config) -> list[str]:
    """The tps up to MAX_TP_LISTED whose ranks all get whole slices of every tensor (rank
    0 built on the meta device; the rules are divisibility rules, the same on every rank).
    Only those that divide the attention heads are tried, so a refusal costs a few builds; a
    build that fails for another reason (a config check) leaves its tp out, so the refusal
    the user gets stays the sharding one."""
    import dataclasses

    from tpserve.distributed import tp_context

    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = next((v for k in ("num_attention_heads", "num_heads", "n_head")
                  if isinstance(v := getattr(text, k, None), int) and v > 0), None)
    works = []
    for tp in range(1, MAX_TP_LISTED + 1):
        if tp == cfg.parallel.tp_size or (heads is not None and heads % tp):
            continue
        other = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp_size=tp))
        try:
            with tp_context(0, tp):
                build_model(other, hf_config, torch.device("meta"))
        except Exception:  # noqa: BLE001 - a tp that fails for any reason is not listed
            continue
        works.append(str(tp))
    return works
