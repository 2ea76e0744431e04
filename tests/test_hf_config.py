"""The config snapshot the launcher hands to the shards (tpserve/hf_config.py) answers every
attribute the model code reads exactly as the transformers config object does, for each
family's real config and the tiny test configs; and a shard given the snapshot builds and
loads its model without importing transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import tiny_models
import torch

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.distributed import tp_context
from tpserve.engine.core import decoder_start_token_id
from tpserve.hf_config import ConfigData, _plain, snapshot
from tpserve.layers.quant.config import resolve_quant
from tpserve.models.registry import model_class
from tpserve.worker.build import build_model

CONFIGS = Path(__file__).parent / "data" / "configs"
MISSING = object()


class Recorder:
    """Reads through to a transformers config, noting each attribute and what it gave."""

    def __init__(self, real) -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "reads", {})

    def __getattr__(self, name: str):
        try:
            value = getattr(self._real, name)
        except AttributeError:
            self.reads[name] = MISSING
            raise
        self.reads[name] = value
        return value


def real_configs():
    from transformers import CONFIG_MAPPING

    out = {}
    for path in sorted(CONFIGS.glob("*.json")):
        d = json.loads(path.read_text())
        out[path.stem] = CONFIG_MAPPING[d["model_type"]].from_dict(d)
    for name in ("llama", "mistral", "gemma", "bloom", "qwen2", "phi3"):
        out[f"tiny-{name}"] = getattr(tiny_models, f"{name}_config")()
    # Quantized checkpoints: quantization_config steers how every linear layer is built.
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2)
    for label, quant in (("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32,
                                   "desc_act": True, "sym": False}),
                         ("awq", {"quant_method": "awq", "bits": 4, "group_size": 32,
                                  "zero_point": True, "version": "GEMM"})):
        cfg = tiny_models.llama_config(**shape)
        cfg.quantization_config = quant
        out[f"tiny-llama-{label}"] = cfg
    return out


CONFIG_OBJECTS = real_configs()


def reads_of(hf, tp: int) -> dict:
    """Every attribute the model code reads while the launcher checks and a shard builds."""
    rec = Recorder(hf)
    cfg = EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                       parallel=ParallelConfig(tp_size=tp))
    model_class(rec)
    assert (resolve_quant("auto", rec, "auto") is None) == (
        getattr(hf, "quantization_config", None) is None)
    decoder_start_token_id("/nonexistent", rec)
    with tp_context(0, tp):
        build_model(cfg, rec, torch.device("meta"))
    return rec.reads


@pytest.mark.parametrize("name", sorted(CONFIG_OBJECTS))
def test_snapshot_answers_what_the_model_code_reads(name):
    hf = CONFIG_OBJECTS[name]
    tp = 2 if name.startswith("tiny") else 4
    reads = reads_of(hf, tp)
    assert len(reads) > 5, f"the recorder saw only {sorted(reads)}"
    data = ConfigData(snapshot(hf))
    for attr, value in reads.items():
        if value is MISSING:
            assert not hasattr(data, attr), f"{name}: {attr} is missing on the config object"
        elif not callable(value):
            ok, plain = _plain(value)
            assert ok, f"{name}: {attr} = {value!r} is not plain data"
            assert getattr(data, attr) == plain, f"{name}: {attr}"


def test_snapshot_resolves_aliases_and_refuses_writes():
    bloom = CONFIG_OBJECTS["bloom-560m"]
    data = ConfigData(snapshot(bloom))
    assert data.num_attention_heads == bloom.n_head == data.n_head
    assert data.num_hidden_layers == bloom.n_layer
    with pytest.raises(AttributeError):
        data.hidden_size = 3
    with pytest.raises(AttributeError, match="no 'not_a_field'"):
        _ = data.not_a_field


def test_a_shard_given_the_snapshot_never_imports_transformers(llama_dir, tmp_path):
    from transformers import AutoConfig

    snap = tmp_path / "snapshot.json"
    snap.write_text(snapshot(AutoConfig.from_pretrained(llama_dir)))
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tpserve.config import EngineConfig, ModelConfig
        from tpserve.worker.worker import Worker
        cfg = EngineConfig(model=ModelConfig(path={str(llama_dir)!r}, model_id="t",
                                             max_model_len=64,
                                             hf_snapshot=Path({str(snap)!r}).read_text()))
        w = Worker(cfg, 0)
        w.init_distributed("127.0.0.1", 0)
        report = w.load_weights()
        print("params", report.param_bytes, "transformers", "transformers" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    words = r.stdout.split()
    assert int(words[words.index("params") + 1]) > 0
    assert words[words.index("transformers") + 1] == "False", r.stdout


def test_a_vision_language_gemma3_is_served_as_its_language_model():
    """gemma-3-4b-it's config.json shape (the language model's settings in text_config, the
    dtype and the tied head on the outer config): tpserve builds Gemma3ForCausalLM from the
    text config, with the outer flags, and the snapshot the shards get says the same."""
    from transformers import CONFIG_MAPPING

    from tpserve.hf_config import ConfigData, snapshot, text_only

    outer = CONFIG_MAPPING["gemma3"].from_dict({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                        "num_attention_heads": 8, "num_key_value_heads": 4,
                        "num_hidden_layers": 34, "head_dim": 256, "intermediate_size": 10240,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024, "query_pre_attn_scalar": 256},
        "vision_config": {"model_type": "siglip_vision_model"}})
    text = ConfigData(snapshot(text_only(outer)))
    assert text.architectures == ["Gemma3ForCausalLM"]
    assert (text.num_attention_heads, text.num_hidden_layers) == (8, 34)
    assert text.tie_word_embeddings is True and text.dtype == "bfloat16"


def test_a_text_only_config_is_left_as_it_is():
    from tiny_models import qwen3_config

    from tpserve.hf_config import text_only

    cfg = qwen3_config()
    assert text_only(cfg) is cfg


def test_an_outer_config_that_answers_from_its_text_config_keeps_its_own_values():
    """transformers 4.5x's Qwen2-VL config answers every name its text config holds from the
    text config (architectures None, the text config's tie flag): tpserve reads the outer
    config's own architectures and tied-head flag."""
    from types import SimpleNamespace

    from tpserve.hf_config import text_only

    class Delegating:  # as Qwen2VLConfig.__getattribute__ in transformers 4.57
        def __getattribute__(self, key):
            text = object.__getattribute__(self, "__dict__").get("text_config")
            if text is not None and key in vars(text):
                return getattr(text, key)
            return object.__getattribute__(self, key)

    outer = Delegating()
    outer.__dict__.update(architectures=["Qwen2VLForConditionalGeneration"],
                          tie_word_embeddings=True, dtype="bfloat16", text_config=SimpleNamespace(
                              model_type="qwen2_vl_text", architectures=None,
                              tie_word_embeddings=False, dtype=None))
    text = text_only(outer)
    assert text.architectures == ["Qwen2ForCausalLM"]
    assert text.tie_word_embeddings is True
