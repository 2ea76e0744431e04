"""config.json files shaped unlike the fixtures': one that names no `architectures` (a
config written by hand or by a config class's own save_pretrained) is built from its
model_type, as transformers' Auto classes do."""

from __future__ import annotations

import json
import shutil

import pytest
from engine_utils import greedy, make_engine
from tiny_models import PROMPTS, hf_greedy

from tpserve.models.registry import model_class


def test_a_config_without_architectures_is_served_by_its_model_type(llama_dir, tmp_path):
    path = tmp_path / "no-architectures"
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    del config["architectures"]
    (path / "config.json").write_text(json.dumps(config))
    engine = make_engine(path, 1, local=True)
    try:
        assert greedy(engine, PROMPTS, 8) == hf_greedy(path, PROMPTS, 8)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("model_type", "want"), [
    ("mistral", "MistralForCausalLM"), ("gemma", "GemmaForCausalLM"),
    ("bloom", "BloomForCausalLM"), ("t5", "T5ForConditionalGeneration")])
def test_model_type_picks_the_family(model_type, want):
    from transformers import CONFIG_MAPPING

    assert model_class(CONFIG_MAPPING[model_type]()).__name__ == want


def test_an_architecture_tpserve_does_not_serve_is_still_refused():
    from transformers import LlamaConfig

    cfg = LlamaConfig(architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        model_class(cfg)
