"""Adapters tpserve cannot serve are refused at start, naming the option or tensor and the
rule; the scheduler's --max-loras limit; prefix-cache chains per adapter (no torch)."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_utils import make_engine
from lora_utils import save_adapter

from tpserve.config import LoraConfig
from tpserve.engine.block_manager import BlockManager
from tpserve.engine.prefix_cache import PrefixCachingBlockManager
from tpserve.engine.request import SamplingParams
from tpserve.engine.scheduler import Scheduler
from tpserve.engine.sequence import Sequence
from tpserve.lora_config import (
    LoraError,
    launch_config,
    parse_lora_modules,
    read_adapter,
    select_adapter,
)


@pytest.fixture(scope="module")
def good(llama_dir, tmp_path_factory):
    return save_adapter(llama_dir, tmp_path_factory.mktemp("lora") / "good", seed=3, r=4)


def with_config(good, tmp_path, **changes):
    out = shutil.copytree(good, tmp_path / "changed")
    cfg = json.loads((out / "adapter_config.json").read_text())
    cfg.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(cfg))
    return out


def test_good_adapter_scale(good, tmp_path):
    assert read_adapter("g", str(good), 64).scale == pytest.approx(8 / 4)
    rs = with_config(good, tmp_path, use_rslora=True, lora_alpha=16)
    assert read_adapter("g", str(rs), 64).scale == pytest.approx(16 / 2)


@pytest.mark.parametrize("changes, match", [
    ({"use_dora": True}, "use_dora = True cannot be served: DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save = \\['lm_head'\\] cannot be served"),
    ({"bias": "lora_only"}, "bias = 'lora_only' cannot be served: only bias = 'none'"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out = True cannot be served"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "peft_type = 'IA3'.*only LORA"),
    ({"r": 128}, "r = 128 cannot be served: the rank must be <= --max-lora-rank \\(64\\)"),
])
def test_options_refused(good, tmp_path, changes, match):
    with pytest.raises(LoraError, match=f"adapter 'x': {match}"):
        read_adapter("x", str(with_config(good, tmp_path, **changes)), 64)


def test_missing_files_refused(tmp_path):
    with pytest.raises(LoraError, match="adapter_config.json not found"):
        read_adapter("x", str(tmp_path), 64)


def test_launch_flags(good):
    cfg = launch_config([f"a={good}", f"b={good}"], 8, 2, "base")
    assert cfg.names == ("a", "b") and cfg.max_loras == 2
    with pytest.raises(LoraError, match="r = 4 .* <= --max-lora-rank \\(2\\)"):
        launch_config([f"a={good}"], 2, 2, "base")
    with pytest.raises(LoraError, match="names adapter 'a' twice"):
        parse_lora_modules(["a=x", "a=y"])
    with pytest.raises(LoraError, match="is the base model's name"):
        parse_lora_modules(["base=x"], "base")
    with pytest.raises(LoraError, match="name=path pairs"):
        parse_lora_modules(["just-a-path"])
    with pytest.raises(LoraError, match="--max-loras \\(0\\) must be >= 1"):
        launch_config([], 8, 0, "base")


def test_cli_refuses_before_start(good, tmp_path, llama_dir, capsys):
    from tpserve.cli import main

    bad = with_config(good, tmp_path, use_dora=True)
    rc = main(["launch", "--model", str(llama_dir), "--lora-modules", f"d={bad}"])
    assert rc == 2
    assert "adapter 'd': use_dora = True cannot be served" in capsys.readouterr().err


def test_select_adapter():
    assert select_adapter(None, "base", ("a",)) is None
    assert select_adapter("base", "base", ("a",)) is None
    assert select_adapter("a", "base", ("a",)) == "a"
    assert select_adapter("anything", "base", ()) is None  # no adapters: as before
    with pytest.raises(ValueError, match="unknown LoRA adapter 'c'.*'a'.*base model is 'base'"):
        select_adapter("c", "base", ("a",))


def test_unsupported_target_refused_at_start(llama_dir, tmp_path):
    """lm_head is not a layer tpserve applies LoRA to: refused naming the module."""
    head = save_adapter(llama_dir, tmp_path / "head", seed=4, targets=("q_proj", "lm_head"))
    with pytest.raises(Exception, match="targets module 'lm_head', which is not a linear "
                                        "layer tpserve applies LoRA to"):
        make_engine(llama_dir, 1, local=True,
                    lora=LoraConfig(adapters=(("head", str(head)),)))


def test_adapter_of_another_model_refused(llama_dir, models_dir, tmp_path):
    from tiny_models import llama_config, save_model

    other = save_model(llama_config(intermediate_size=96), models_dir / "llama_i96")
    adapter = save_adapter(other, tmp_path / "other", seed=5, targets=("down_proj",))
    with pytest.raises(Exception, match="down_proj.lora_A.weight' has shape \\[4, 96\\] but "
                                        "the base model implies \\[4, 128\\]"):
        make_engine(llama_dir, 1, local=True,
                    lora=LoraConfig(adapters=(("other", str(adapter)),)))


def _seq(i: int, adapter: int, prompt: list[int] | None = None) -> Sequence:
    seq = Sequence(i, prompt or [1, 2, 3], SamplingParams(max_new_tokens=4))
    seq.adapter = adapter
    return seq


def test_scheduler_keeps_max_loras_per_step():
    sched = Scheduler(BlockManager(64, 4), 16, 256, max_loras=2)
    for i, adapter in enumerate([1, 0, 2, 1, 3, 0]):
        sched.add(_seq(i, adapter))
    first = sched.schedule()
    # In arrival order: adapter 3 waits (two adapters run), and so does everything after it.
    assert [s.seq.adapter for s in first] == [1, 0, 2, 1]
    sched.after_step(first)
    for s in first:
        if s.seq.adapter == 1:
            sched.finish(s.seq)
    second = sched.schedule()
    assert sorted(s.seq.adapter for s in second) == [0, 0, 2, 3]


def test_prefix_chain_per_adapter():
    blocks = PrefixCachingBlockManager(32, 4)
    prompt = list(range(10, 23))
    base = _seq(0, 0, prompt)
    blocks.grow(base, len(prompt))
    base.num_computed = len(prompt)
    blocks.after_compute(base)
    for adapter, hits in ((1, 0), (0, 3)):
        seq = _seq(1 + adapter, adapter, prompt)
        blocks.reuse_prefix(seq)
        assert len(seq.block_table) == hits
        blocks.free(seq)
