"""PEFT LoRA adapter directories as the launcher reads them: `--lora-modules name=path`, each
adapter's adapter_config.json checked against what tpserve serves (docs/lora.md). Plain
Python: the launcher refuses an adapter before any shard starts, and every shard reads the
same spec again when it loads its slice (worker/lora_loader.py)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the option and the rule."""


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    path: str
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora


def parse_lora_modules(items: list[str], base_name: str | None = None
                       ) -> tuple[tuple[str, str], ...]:
    """`name=path` pairs of --lora-modules, in order; names unique and not the base model's."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        name, path = name.strip(), path.strip()
        if not sep or not name or not path:
            raise LoraError(f"--lora-modules takes name=path pairs; got {item!r}")
        if not _NAME.match(name):
            raise LoraError(f"--lora-modules: adapter name {name!r} must start with a letter or "
                            "digit and hold only letters, digits and . _ : / -")
        if name in out:
            raise LoraError(f"--lora-modules names adapter {name!r} twice")
        if base_name is not None and name == base_name:
            raise LoraError(f"--lora-modules: adapter name {name!r} is the base model's name, "
                            "which selects no adapter; choose another")
        out[name] = path
    return tuple(out.items())


def _refuse(name: str, option: str, value: object, rule: str) -> LoraError:
    return LoraError(f"LoRA adapter {name!r}: {option} = {value!r} cannot be served: {rule}")


def read_adapter(name: str, path: str, max_rank: int) -> AdapterSpec:
    """The adapter's rank and scale, or a LoraError naming the option it cannot serve."""
    directory = Path(path)
    cfg_path, weights = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for f in (cfg_path, weights):
        if not f.is_file():
            raise LoraError(f"LoRA adapter {name!r}: {f} not found; --lora-modules takes a "
                            f"local PEFT adapter directory holding {CONFIG_FILE} and "
                            f"{WEIGHTS_FILE} (a hub id is not downloaded: fetch it first with "
                            "`hf download ORG/NAME` and pass its snapshot directory)")
    cfg = json.loads(cfg_path.read_text())
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(name, "peft_type", peft_type, "only LORA adapters are served")
    if cfg.get("use_dora"):
        raise _refuse(name, "use_dora", True, "DoRA adapters are not served")
    if cfg.get("modules_to_save"):
        raise _refuse(name, "modules_to_save", cfg["modules_to_save"],
                      "an adapter must not replace whole modules of the base model")
    if cfg.get("bias", "none") != "none":
        raise _refuse(name, "bias", cfg["bias"], "only bias = 'none' is served")
    if cfg.get("fan_in_fan_out"):
        raise _refuse(name, "fan_in_fan_out", True, "only fan_in_fan_out = false (nn.Linear "
                      "targets) is served")
    for option in ("rank_pattern", "alpha_pattern"):
        if cfg.get(option):
            raise _refuse(name, option, cfg[option], "one rank and alpha for every module only")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(name, "r", rank, "the rank must be a positive integer")
    if rank > max_rank:
        raise _refuse(name, "r", rank, f"the rank must be <= --max-lora-rank ({max_rank}); "
                      "raise --max-lora-rank")
    alpha = cfg.get("lora_alpha", 8)
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterSpec(name, str(directory), rank, float(scale))


def read_adapters(adapters: tuple[tuple[str, str], ...], max_rank: int) -> list[AdapterSpec]:
    return [read_adapter(name, path, max_rank) for name, path in adapters]


def unknown_adapter(name: str, known: tuple[str, ...]) -> str:
    """The 422 message for a request naming an adapter this server did not load."""
    listed = ", ".join(repr(n) for n in known) if known else "none (no --lora-modules)"
    return (f"unknown LoRA adapter {name!r}: this server serves adapters {listed}; name one "
            "of them, or the base model, or none")


def select_adapter(name: str | None, base_name: str, adapters: tuple[str, ...]) -> str | None:
    """The adapter a request's name selects: None for no name or the base model's; a
    ValueError (the server's 422) for a name that is neither, where adapters are served."""
    if name is None or name == base_name:
        return None
    if name in adapters:
        return name
    if not adapters:  # no adapters: any `model` name reaches the one model, as before
        return None
    raise ValueError(unknown_adapter(name, adapters) + f" (the base model is {base_name!r})")


def launch_config(items: list[str] | None, max_rank: int, max_loras: int, base_name: str):
    """The LoraConfig of `tpserve launch`'s flags, every adapter read and checked (LoraError
    naming the flag, option or rule) before any shard starts."""
    from tpserve.config import LoraConfig

    if max_rank < 1 or max_loras < 1:
        raise LoraError(f"--max-lora-rank ({max_rank}) and --max-loras ({max_loras}) must be "
                        ">= 1")
    pairs = parse_lora_modules(items or [], base_name)
    pairs = tuple((name, str(Path(path).expanduser().resolve())) for name, path in pairs)
    read_adapters(pairs, max_rank)
    return LoraConfig(adapters=pairs, max_rank=max_rank, max_loras=max_loras)
