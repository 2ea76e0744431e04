"""config.json files shaped unlike the fixtures': one that names no `architectures` (a
config written by hand or by a config class's own save_pretrained) is built from its
model_type, as transformers' Auto classes do, and so is one whose `architectures` names
another served family than its model_type."""

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
    ("bloom", "BloomForCausalLM"), ("t5", "T5ForConditionalGeneration"),
    ("gpt_bigcode", "GPTBigCodeForCausalLM"), ("cohere", "CohereForCausalLM"),
    ("cohere2", "Cohere2ForCausalLM"), ("deepseek_v2", "DeepseekV2ForCausalLM"),
    ("deepseek_v3", "DeepseekV3ForCausalLM"), ("nemotron", "NemotronForCausalLM"),
    ("falcon", "FalconForCausalLM")])
def test_model_type_picks_the_family(model_type, want):
    from transformers import CONFIG_MAPPING

    assert model_class(CONFIG_MAPPING[model_type]()).__name__ == want


def test_falcons_legacy_label_serves_falcon_and_only_falcon():
    """RWForCausalLM, the name Falcon's first (remote-code) releases gave the model, on a
    `falcon` config is Falcon (transformers builds it from model_type alone); on another
    family's config it gives way to that family, as any built-in label does."""
    from transformers import FalconConfig, LlamaConfig

    assert model_class(FalconConfig(architectures=["RWForCausalLM"])).__name__ == \
        "FalconForCausalLM"
    assert model_class(LlamaConfig(architectures=["RWForCausalLM"])).__name__ == \
        "LlamaForCausalLM"


def test_an_architecture_tpserve_does_not_serve_is_still_refused():
    from transformers import LlamaConfig

    cfg = LlamaConfig(architectures=["LlamaForSequenceClassification"])
    with pytest.raises(ValueError, match="LlamaForSequenceClassification"):
        model_class(cfg)


@pytest.mark.parametrize(("heads", "kv", "tp", "rule", "tps"), [
    (12, 2, 3, "2 key/value heads can be replicated only", "1, 2, 4, 6 or 12"),
    (6, 3, 2, "key/value heads = 3 is not divisible by 2", "1, 3 or 6")])
def test_kv_heads_that_cannot_shard_name_the_tps_that_work(heads, kv, tp, rule, tps):
    """12 heads, 2 KV heads (6:1) at tp = 3: 3 divides the heads but 2 KV heads neither
    split nor replicate over 3 ranks; 6 heads, 3 KV heads at tp = 2 likewise. The refusal
    lists the tps that work (tp = 6 replicates the 3 KV heads)."""
    from tiny_models import llama_config

    from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
    from tpserve.errors import ShardingError
    from tpserve.worker.build import check_shardable

    hf = llama_config(hidden_size=96, num_attention_heads=heads, num_key_value_heads=kv)
    cfg = EngineConfig(model=ModelConfig(path="u", model_id="u", max_model_len=64),
                       parallel=ParallelConfig(tp_size=tp))
    with pytest.raises(ShardingError) as err:
        check_shardable(cfg, hf)
    msg = str(err.value)
    shape = f"[{kv * 96 // heads}, 96]"
    for needle in ("'model.layers.0.self_attn.k_proj.weight'", shape, f"tp={tp}", rule,
                   f"tp = {tps}."):
        assert needle in msg, msg


def _relabelled(src, dst, arch: str):
    """A copy of checkpoint src whose config.json names `arch` in `architectures`."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


# (family fixture, the architecture its config.json names instead): Qwen2's q/k/v biases
# were dropped as unexpected tensors under Llama (wrong text, one warning); Qwen3 under
# Qwen2 was refused at load for want of those biases.
RELABELLED = [("qwen2", "LlamaForCausalLM"), ("qwen3", "Qwen2ForCausalLM")]


@pytest.mark.parametrize(("family", "arch"), RELABELLED, ids=[f"{f}-as-{a}" for f, a in RELABELLED])
def test_the_model_type_decides_the_family_as_in_transformers(models_dir, tmp_path, family,
                                                             arch):
    from tiny_models import family_checkpoint

    src = family_checkpoint(models_dir, family)
    path = _relabelled(src, tmp_path / f"{family}-as-{arch}", arch)
    ref = hf_greedy(path, PROMPTS, 8)
    assert ref == hf_greedy(src, PROMPTS, 8)  # transformers ignores the label
    engine = make_engine(path, 1, local=True)
    try:
        assert greedy(engine, PROMPTS, 8) == ref
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("model_type", "arch", "want"), [
    ("umt5", "T5ForConditionalGeneration", "UMT5ForConditionalGeneration"),
    ("mt5", "T5ForConditionalGeneration", "MT5ForConditionalGeneration"),
    ("llama", "MistralForCausalLM", "LlamaForCausalLM")])
def test_a_family_label_gives_way_to_the_model_type(model_type, arch, want):
    """UMT5's per-layer relative biases and mT5's unscaled decoder output follow the
    model_type, not a T5 label; so does Llama's lack of a window under a Mistral label."""
    from transformers import CONFIG_MAPPING

    assert model_class(CONFIG_MAPPING[model_type](architectures=[arch])).__name__ == want


# (config builder kwargs, tp, what the refusal must say). Phi-3 stores q/k/v and gate/up
# fused, so a refusal names qkv_proj / gate_up_proj (its whole shape), not the q_proj or
# gate_proj its file does not have; a head count that tp does not divide lists the tps
# that work for the KV heads too (3 divides 6 heads, but 2 KV heads do not shard over 3).
PHI3_REFUSALS = [
    (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2), 4,
     ["'model.layers.0.self_attn.qkv_proj.weight'", "[160, 96]", "tp=4",
      "attention heads = 6 is not divisible by 4", "tp = 1, 2 or 6."]),
    (dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3), 2,
     ["'model.layers.0.self_attn.qkv_proj.weight'", "[192, 96]", "tp=2",
      "key/value heads = 3 is not divisible by 2", "tp = 1, 3 or 6."]),
    (dict(intermediate_size=202), 4,
     ["'model.layers.0.mlp.gate_up_proj.weight'", "[404, 64]", "tp=4",
      "intermediate size = 202 is not divisible by 4"]),
]


@pytest.mark.parametrize(("kw", "tp", "needles"), PHI3_REFUSALS,
                         ids=["heads", "kv-heads", "intermediate"])
def test_phi3_refusals_name_its_fused_tensors(kw, tp, needles):
    from tiny_models import phi3_config

    from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
    from tpserve.errors import ShardingError
    from tpserve.worker.build import check_shardable

    cfg = EngineConfig(model=ModelConfig(path="u", model_id="u", max_model_len=64),
                       parallel=ParallelConfig(tp_size=tp))
    with pytest.raises(ShardingError) as err:
        check_shardable(cfg, phi3_config(**kw))
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def _tied_copy(src, dst, keep_head: bool):
    """src (an untied checkpoint) with tie_word_embeddings true in config.json; keep_head:
    its own lm_head.weight stays in the file (it differs from the embeddings), else it is
    removed (the head is the embeddings)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["tie_word_embeddings"] = True
    (dst / "config.json").write_text(json.dumps(config))
    if not keep_head:
        tensors = load_file(str(dst / "model.safetensors"))
        del tensors["lm_head.weight"]
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_a_tied_config_over_a_stored_head_serves_the_stored_head(llama_dir, tmp_path, tp):
    """config.json ties the head, the file stores one that differs from the embeddings:
    transformers serves the stored head (it ties only equal or missing tensors), and so
    does tpserve, at tp = 1 and 2. The same config without the stored head is tied, and
    its tokens differ (the guard: which head is served shows in the tokens)."""
    stored = _tied_copy(llama_dir, tmp_path / "tied-stored-head", keep_head=True)
    tied = _tied_copy(llama_dir, tmp_path / "tied", keep_head=False)
    want, want_tied = hf_greedy(stored, PROMPTS, 8), hf_greedy(tied, PROMPTS, 8)
    assert want == hf_greedy(llama_dir, PROMPTS, 8)  # transformers: the stored head
    assert want != want_tied
    for path, tokens in ((stored, want), (tied, want_tied)):
        engine = make_engine(path, tp, local=tp == 1, forked=tp > 1)
        try:
            assert greedy(engine, PROMPTS, 8) == tokens, path.name
        finally:
            engine.shutdown()


def test_tensor_names_follow_a_checkpoint_rewritten_in_place(tmp_path):
    """The names are cached for start-up's repeated config loads; a file rewritten at the same
    path (a converter run again, a test fixture) must not serve its old names."""
    import torch
    from safetensors.torch import save_file

    from tpserve.weights import tensor_names

    f = tmp_path / "model.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(f))
    assert tensor_names(tmp_path) == ["model.embed_tokens.weight"]
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2),
               "lm_head.weight": torch.ones(3, 2)}, str(f))
    assert sorted(tensor_names(tmp_path)) == ["lm_head.weight", "model.embed_tokens.weight"]
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model.safetensors"}}))
    assert tensor_names(tmp_path) == ["lm_head.weight"]


@pytest.mark.parametrize(("family", "overrides", "tp", "tensor", "rule", "tps"), [
    ("llama", {"intermediate_size": 130}, 4, "'model.layers.0.mlp.gate_proj.weight'",
     "intermediate size = 130 is not divisible by 4", "1 or 2"),
    ("gemma", {"intermediate_size": 130}, 4, "'model.layers.0.mlp.gate_proj.weight'",
     "intermediate size = 130 is not divisible by 4", "1 or 2"),
    # 6 heads split at tp = 3 and 6, but intermediate 128 does not.
    ("llama", {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 6}, 4,
     "'model.layers.0.self_attn.q_proj.weight'", "attention heads = 6 is not divisible by 4",
     "1 or 2"),
    ("bloom", {"hidden_size": 48, "n_head": 3}, 2,
     "'transformer.h.0.self_attention.query_key_value.weight'",
     "attention heads = 3 is not divisible by 2", "1 or 3"),
    ("t5", {"d_ff": 98}, 4, "'encoder.block.0.layer.1.DenseReluDense.wi_0.weight'",
     "output features = 98 is not divisible by 4", "1 or 2")])
def test_a_refusal_names_the_tps_the_whole_model_shards_at(family, overrides, tp, tensor,
                                                           rule, tps):
    """A width that divides neither tp names its tensor and rule, then the tps at which
    every tensor of the model splits (the rule alone said "Choose a tp that divides 130",
    which tp = 5 or 10 would pass and the heads refuse)."""
    import tiny_models

    from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
    from tpserve.errors import ShardingError
    from tpserve.worker.build import check_shardable

    hf = getattr(tiny_models, f"{family}_config")(**overrides)
    cfg = EngineConfig(model=ModelConfig(path="u", model_id="u", max_model_len=64),
                       parallel=ParallelConfig(tp_size=tp))
    with pytest.raises(ShardingError) as err:
        check_shardable(cfg, hf)
    msg = str(err.value)
    for needle in (tensor, f"tp={tp}", rule, f"The whole model shards at tp = {tps} "):
        assert needle in msg, msg
