"""Checkpoint paths a hostile or careless checkpoint can name: the index of a sharded
checkpoint must not send the loader outside the checkpoint directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tpserve.errors import CheckpointError
from tpserve.weights import safetensors_files


def _checkpoint(tmp_path: Path, names: list[str]) -> Path:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "outside.safetensors"))
    save_file({"v": torch.zeros(2)}, str(ckpt / "model-1.safetensors"))
    weight_map = {f"t{i}": name for i, name in enumerate(names)}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return ckpt


@pytest.mark.parametrize("name", ["../outside.safetensors", "ABS", "sub/../../outside.safetensors"])
def test_index_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, name):
    if name == "ABS":
        name = str(tmp_path / "outside.safetensors")
    ckpt = _checkpoint(tmp_path, ["model-1.safetensors", name])
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        safetensors_files(ckpt)


def test_index_with_plain_file_names_still_loads(tmp_path):
    ckpt = _checkpoint(tmp_path, ["model-1.safetensors", "model-1.safetensors"])
    assert safetensors_files(ckpt) == [ckpt / "model-1.safetensors"]
