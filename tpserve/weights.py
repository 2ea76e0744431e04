"""Checkpoint resolution and sliced safetensors reads.

Each rank opens the safetensors files itself and asks for its own slice of every tensor
through `get_slice`, so a tp-way shard materialises about 1/tp of each sharded tensor.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tpserve.errors import CheckpointError

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
log = logging.getLogger(__name__)


def hub_cache_dir() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.HF_HUB_CACHE)
    except Exception:  # noqa: BLE001 - an old hub library; fall back to its documented default
        return os.path.expanduser("~/.cache/huggingface/hub")


def resolve_model(model: str | None, revision: str | None = None, weights: bool = True,
                  download_timeout: float | None = None) -> Path:
    """A local directory, or a hub id: from the local hub cache, else downloaded into it
    (tpserve/hub.py; HF_HUB_OFFLINE=1 forbids the download, and download_timeout bounds each
    silence of the hub). weights=False: a hub id needs only its config and tokenizer
    (--load-format dummy)."""
    if model is None:
        if revision:
            log.warning("--revision %s is ignored: it selects a revision of a hub id given "
                        "with --model", revision)
        if not (DEFAULT_MODEL_DIR / "config.json").exists():
            raise CheckpointError(
                f"the embedded default model is missing from {DEFAULT_MODEL_DIR}; "
                "rebuild it with `python scripts/train_default_model.py` or pass --model"
            )
        return DEFAULT_MODEL_DIR
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "config.json").exists():
            raise CheckpointError(f"{local.resolve()} is a directory but has no config.json")
        if revision:
            from tpserve.hub import is_hub_id

            shadows = (f"; it shadows the hub id {model}: run from another directory to "
                       "download that") if is_hub_id(model) else ""
            log.warning("--revision %s is ignored: %s is a local directory, served as it is%s",
                        revision, local.resolve(), shadows)
        return local.resolve()
    from tpserve import hub

    if not hub.is_hub_id(model):
        raise CheckpointError(
            f"model {model!r} not found: {local.resolve()} does not exist (a path; a hub id "
            "looks like org/name)")
    return hub.ensure_model(model, revision, weights, download_timeout)


def node_model_path(path: str, model_id: str, revision: str | None = None,
                    weights: bool = True, download_timeout: float | None = None) -> Path:
    """The checkpoint directory on this node. The launching node resolved `path`; a shard on
    another node without that directory (no shared file system) resolves the hub id itself,
    downloading into its own node's cache."""
    p = Path(path)
    if p.is_dir():
        return p
    from tpserve import hub

    if hub.is_hub_id(model_id):
        if p.parent.name == "snapshots":  # pin the commit the launching node resolved, so
            revision = p.name             # every shard reads the same weights
        return hub.ensure_model(model_id, revision, weights, download_timeout)
    raise CheckpointError(
        f"{path} does not exist on this node: put the checkpoint on a file system every node "
        "mounts at the same path, or copy it to that path on every node")


def load_hf_config(path: Path | str):
    """The checkpoint's transformers config, as tpserve builds the model from it (for a
    vision-language checkpoint served as text only, its text config: hf_config.text_only)."""
    from transformers import AutoConfig

    from tpserve.hf_config import text_only

    outer = AutoConfig.from_pretrained(str(path))
    config = text_only(outer)
    if not getattr(config, "is_encoder_decoder", False):
        _untie_a_stored_head(config, Path(path))
    return adopt_quant_file(config, Path(path))


def _untie_a_stored_head(text_config, path: Path) -> None:
    """A config may tie the head to the embeddings (tie_word_embeddings, or a config class
    that ties by default, as Mistral3Config does for its text) over a checkpoint that stores
    a head of its own (lm_head.weight, language_model.lm_head.weight): a fine-tune that
    trained its head apart from a tied base, or a converter that wrote both. transformers
    ties only where the file lacks one of the two or holds them equal ("both are present in
    the checkpoints with different values, so we will NOT tie them"), so a stored head is
    the one it serves, and tpserve loads it too: equal tensors give the same logits either
    way, at the cost of holding the head twice. Encoder-decoder models (T5) keep their own
    rule: their config's tying also scales the decoder's output."""
    if getattr(text_config, "tie_word_embeddings", False) and any(
            name.endswith("lm_head.weight") for name in tensor_names(path)):
        text_config.tie_word_embeddings = False


def tensor_names(path: Path) -> list[str]:
    """The names of the checkpoint's tensors, from its index or the files' headers; none
    where it has no weights (--load-format dummy)."""
    index = path / "model.safetensors.index.json"
    files = [index] if index.exists() else weight_files(path)
    # Start-up asks several times (cli, executor, engine, worker: each loads the config);
    # the files' sizes and times key the cache, so a checkpoint rewritten in place is read anew.
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return list(_tensor_names(stamp))


@functools.lru_cache(maxsize=32)
def _tensor_names(stamp: tuple[tuple[str, int, int], ...]) -> tuple[str, ...]:
    files = [Path(f) for f, _, _ in stamp]
    if files and files[0].name == "model.safetensors.index.json":
        return tuple(json.loads(files[0].read_text())["weight_map"])
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            names += list(st.keys())
    return tuple(names)


# Quantizers that wrote their settings to a file of their own, with the method it implies:
# AutoGPTQ before its settings joined config.json (older releases name no quant_method),
# early AutoAWQ (w_bit, q_group_size, version "GEMM").
QUANT_FILES = (("quantize_config.json", "gptq"), ("quant_config.json", "awq"))


def adopt_quant_file(hf_config, path: Path):
    """hf_config, given the quantization_config of a side file where config.json has none
    (transformers ignores those files and would build a float model)."""
    if getattr(hf_config, "quantization_config", None):
        return hf_config
    for name, method in QUANT_FILES:
        f = path / name
        if f.is_file():
            q = json.loads(f.read_text())
            q["quant_method"] = str(q.get("quant_method") or method).lower()
            hf_config.quantization_config = q
            break
    return hf_config


def weight_files(path: Path) -> list[Path]:
    """A checkpoint without an index: its model.safetensors alone where it has one, as
    transformers loads it (Mistral's repositories ship a consolidated.safetensors in their
    own tensor names beside it), else every *.safetensors file."""
    single = path / "model.safetensors"
    return [single] if single.is_file() else sorted(path.glob("*.safetensors"))


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        for name in names:  # the index is the checkpoint's data, not a path to trust
            if Path(name).is_absolute() or ".." in Path(name).parts:
                raise CheckpointError(f"{index} names {name!r}, a file outside the checkpoint "
                                      "directory: shard files must be inside it")
        return [path / name for name in names]
    files = weight_files(path)
    if not files:
        found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" (found {', '.join(found)}: convert them to safetensors first)" if found else ""
        raise CheckpointError(f"no *.safetensors weights in {path}{hint}")
    return files


_DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass
class LoadStats:
    """Bytes each checkpoint tensor occupies on disk and how many this rank read of it."""

    full_bytes: dict[str, int] = field(default_factory=dict)
    read_bytes: dict[str, int] = field(default_factory=dict)

    def fraction(self, name: str) -> float:
        return self.read_bytes.get(name, 0) / max(self.full_bytes[name], 1)


class TensorSlice:
    """A lazy checkpoint tensor: read the whole of it or only an index of it."""

    def __init__(self, name: str, raw, stats: LoadStats) -> None:
        self.name, self._raw, self._stats = name, raw, stats
        self.shape = tuple(raw.get_shape())
        stats.full_bytes[name] = math.prod(self.shape) * _DTYPE_SIZES.get(raw.get_dtype(), 4)

    def __getitem__(self, index) -> torch.Tensor:
        t = self._raw[index]
        self._stats.read_bytes[self.name] = (
            self._stats.read_bytes.get(self.name, 0) + t.numel() * t.element_size()
        )
        return t

    def all(self) -> torch.Tensor:
        return self[:]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        return self[tuple(index)]


def iter_checkpoint(
    path: Path, stats: LoadStats, show_progress: bool = True, desc: str = "loading weights"
) -> Iterator[TensorSlice]:
    files = safetensors_files(path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    names = [(h, n) for h in handles for n in h.keys()]
    for handle, name in tqdm(names, desc=desc, unit="tensor", disable=not show_progress,
                             dynamic_ncols=True):
        yield TensorSlice(name, handle.get_slice(name), stats)
