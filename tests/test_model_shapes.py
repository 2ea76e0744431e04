"""Every rank's model for the real configs in tests/data/configs, built on the meta device
(no weights, no memory): the per-rank parameters add back up to transformers' own parameter
count for tp = 1, 2, 4, 8, once the copies tensor parallelism makes on purpose are counted
(replicated norms and row-parallel biases, vocabulary padding, replicated KV heads). A tp a
model cannot take is refused with a ShardingError naming the tensor, its shape, tp and rule."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
from tpserve.distributed import tp_context
from tpserve.errors import ShardingError
from tpserve.worker.build import build_model, check_shardable

CONFIGS = Path(__file__).parent / "data" / "configs"
DECODERS = ["gemma-7b", "gemma-2b", "gemma-2-9b", "OpenHermes-2.5-Mistral-7B", "bloom-560m",
            "Meta-Llama-3-8B", "Llama-3.1-8B", "Qwen3-8B", "Mixtral-8x7B-v0.1",
            "Qwen3-30B-A3B", "Qwen1.5-MoE-A2.7B-Chat"]


def hf_config(name: str, **overrides):
    from transformers import CONFIG_MAPPING

    d = json.loads((CONFIGS / f"{name}.json").read_text())
    d.update(overrides)
    return CONFIG_MAPPING[d["model_type"]].from_dict(d)


def engine_cfg(tp: int) -> EngineConfig:
    return EngineConfig(model=ModelConfig(path="unused", model_id="unused", max_model_len=64),
                        parallel=ParallelConfig(tp_size=tp))


def numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied parameters count once


def assert_ranks_add_up(hf, tp: int, full: int, replicated: int) -> None:
    """The tp ranks' models built on the meta device hold `full` parameters between them,
    plus (tp - 1) more copies of the `replicated` ones every rank holds whole."""
    total = 0
    for rank in range(tp):
        with tp_context(rank, tp):
            total += numel(build_model(engine_cfg(tp), hf, torch.device("meta")))
    assert total == full + (tp - 1) * replicated


def assert_refused(hf, tp: int, needles) -> None:
    """check_shardable refuses hf at tp with a message holding every needle."""
    with pytest.raises(ShardingError) as err:
        check_shardable(engine_cfg(tp), hf)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


# Parameters every rank holds whole: norms and the biases of row-parallel layers (added
# once, after the all-reduce).
REPLICATED = ("norm", "ln_f", "o_proj.bias", "down_proj.bias", "dense.bias",
              "dense_4h_to_h.bias", "mlp.gate.weight",  # the experts' router
              "shared_expert_gate.weight")  # Qwen2-MoE's gate of its shared expert


@functools.cache
def transformers_counts(name: str) -> tuple[int, int]:
    """The oracle, transformers' own model on the meta device: (all parameters, those
    every rank replicates), counted by transformers' parameter names."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(name))
    replicated = sum(p.numel() for n, p in model.named_parameters()
                     if any(r in n for r in REPLICATED))
    return numel(model), replicated


def expected_rank_sum(name: str, hf, tp: int) -> int:
    hidden, vocab = hf.hidden_size, hf.vocab_size
    layers = hf.num_hidden_layers
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    full, replicated = transformers_counts(name)
    total = full + (tp - 1) * replicated
    # Vocabulary rows are padded to a multiple of tp (zero rows, logits cut off).
    total += ((-vocab) % tp) * hidden * (1 if tied else 2)
    # With fewer KV heads than ranks, each rank holds one whole KV head (k and v).
    kv = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    if kv < tp:
        head_dim = getattr(hf, "head_dim", None) or hidden // hf.num_attention_heads
        bias = 1 if getattr(hf, "attention_bias", False) else 0
        total += layers * (tp - kv) * 2 * head_dim * (hidden + bias)
    return total


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", DECODERS)
def test_rank_shapes_add_up_to_the_full_model(name, tp):
    hf = hf_config(name)
    shapes, total = [], 0
    for rank in range(tp):
        with tp_context(rank, tp):
            model = build_model(engine_cfg(tp), hf, torch.device("meta"))
        shapes.append({n: tuple(p.shape) for n, p in model.named_parameters()})
        total += numel(model)
    assert all(s == shapes[0] for s in shapes), "every rank should hold equal shapes"
    assert total == expected_rank_sum(name, hf, tp)


def test_kv_replication_is_counted_for_multi_query_gemma():
    """gemma-2b has one KV head: at tp = 8 each rank holds a copy (8 heads, 1 per rank)."""
    hf = hf_config("gemma-2b")
    with tp_context(3, 8):
        model = build_model(engine_cfg(8), hf, torch.device("meta"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_head_start) == (1, 1, 0)
    assert tuple(qkv.weight.shape) == (3 * 256, 2048)


REFUSED = [
    # (config, overrides, tp, what the message must name)
    ("gemma-7b", {}, 3,
     ["'model.layers.0.self_attn.q_proj.weight'", "[4096, 3072]", "tp=3",
      "attention heads = 16 is not divisible by 3"]),
    ("gemma-2b", {}, 16,
     ["'model.layers.0.self_attn.q_proj.weight'", "[2048, 2048]", "tp=16",
      "attention heads = 8 is not divisible by 16"]),
    ("gemma-2-9b", {}, 32,
     ["'model.layers.0.self_attn.q_proj.weight'", "[4096, 3584]", "tp=32",
      "attention heads = 16 is not divisible by 32"]),
    ("bloom-560m", {}, 32,
     ["'transformer.h.0.self_attention.query_key_value.weight'", "[3072, 1024]", "tp=32",
      "attention heads = 16 is not divisible by 32"]),
    ("OpenHermes-2.5-Mistral-7B", {}, 64,
     ["'model.layers.0.self_attn.q_proj.weight'", "[4096, 4096]", "tp=64",
      "attention heads = 32 is not divisible by 64"]),
    ("Meta-Llama-3-8B", {}, 6,
     ["'model.layers.0.self_attn.q_proj.weight'", "[4096, 4096]", "tp=6",
      "attention heads = 32 is not divisible by 6"]),
    ("Qwen3-8B", {}, 3,
     ["'model.layers.0.self_attn.q_proj.weight'", "[4096, 4096]", "tp=3",
      "attention heads = 32 is not divisible by 3"]),
    ("Qwen3-30B-A3B", {}, 3,
     ["'model.layers.0.self_attn.q_proj.weight'", "[4096, 2048]", "tp=3",
      "attention heads = 32 is not divisible by 3"]),
    # Synthetic widths for the mixture-of-experts rules: the experts', the shared expert's
    # and, among sparse layers, a dense layer's (mlp_only_layers).
    ("Qwen3-30B-A3B", {"moe_intermediate_size": 100}, 8,
     ["'model.layers.0.mlp.experts.0.gate_proj.weight'", "[100, 2048]", "tp=8",
      "expert intermediate size = 100 is not divisible by 8"]),
    ("Qwen3-30B-A3B", {"mlp_only_layers": [5], "intermediate_size": 6150}, 4,
     ["'model.layers.5.mlp.gate_proj.weight'", "[6150, 2048]", "tp=4",
      "intermediate size = 6150 is not divisible by 4"]),
    ("Qwen1.5-MoE-A2.7B-Chat", {"shared_expert_intermediate_size": 5636}, 8,
     ["'model.layers.0.mlp.shared_expert.gate_proj.weight'", "[5636, 2048]", "tp=8",
      "intermediate size = 5636 is not divisible by 8"]),
    # Synthetic head counts (24 heads, 6 KV heads) for the two KV-head rules.
    ("gemma-7b", {"num_attention_heads": 24, "num_key_value_heads": 6}, 4,
     ["'model.layers.0.self_attn.k_proj.weight'", "[1536, 3072]", "tp=4",
      "key/value heads = 6 is not divisible by 4"]),
    ("gemma-7b", {"num_attention_heads": 24, "num_key_value_heads": 6}, 8,
     ["'model.layers.0.self_attn.k_proj.weight'", "[1536, 3072]", "tp=8",
      "6 key/value heads can be replicated only when tp is a multiple of them"]),
]


@pytest.mark.parametrize(("name", "overrides", "tp", "needles"), REFUSED,
                         ids=[f"{r[0]}-tp{r[2]}" + ("-synthetic" if r[1] else "")
                              for r in REFUSED])
def test_impossible_tp_is_refused_with_the_tensor_and_rule(name, overrides, tp, needles):
    with pytest.raises(ShardingError) as err:
        check_shardable(engine_cfg(tp), hf_config(name, **overrides))
    for needle in needles:
        assert needle in str(err.value)


def test_launch_refuses_a_checkpoint_whose_heads_do_not_divide(tmp_path, capsys):
    """`tpserve launch --tp 4` on a 6-head Bloom checkpoint stops before any shard starts,
    with the tensor, its shape, tp and the rule on stderr (exit status 2)."""
    from tiny_models import bloom_config, save_model

    from tpserve.cli import main

    path = save_model(bloom_config(hidden_size=96, n_head=6), tmp_path / "bloom6")
    assert main(["launch", "--model", str(path), "--tp", "4", "--device", "cpu",
                 "--no-dashboard"]) == 2
    err = capsys.readouterr().err
    for needle in ["'transformer.h.0.self_attention.query_key_value.weight'", "[288, 96]",
                   "tp=4", "attention heads = 6 is not divisible by 4"]:
        assert needle in err


@pytest.mark.parametrize(("name", "kind"), [("Llama-3.1-8B", "llama3"),
                                            ("Meta-Llama-3-8B", "default")])
def test_rope_of_the_real_llama3_configs_matches_transformers(name, kind):
    """Meta-Llama-3-8B has no rope scaling (theta 500000); Llama 3.1 brings the llama3 type."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tpserve.layers.rotary import inv_frequencies, rope_parameters

    hf = hf_config(name)
    params = rope_parameters(hf)
    assert params["rope_type"] == kind and params["rope_theta"] == 500000.0
    got, scale = inv_frequencies(128, params)
    if kind == "default":
        want = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    else:
        want, _ = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert scale == 1.0


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_starcoder_shapes_add_up_with_the_kv_head_and_positions_replicated(tp):
    """StarCoder-15B's dimensions (GPTBigCode, multi_query: 48 heads of 128, one KV head,
    40 layers, n_inner 24576, vocab 49152, 8192 positions, tied head), typed in rather than
    a stored config.json. Every rank holds its 48 / tp query heads plus the whole k and v
    head (weight rows and bias), the whole wpe, the norms and the c_proj biases; the rest
    adds up to transformers' count. tp = 5 is refused naming c_attn."""
    from transformers import AutoModelForCausalLM, GPTBigCodeConfig

    hf = GPTBigCodeConfig(n_embd=6144, n_head=48, n_layer=40, n_inner=24576, vocab_size=49152,
                          n_positions=8192, multi_query=True, tie_word_embeddings=True,
                          architectures=["GPTBigCodeForCausalLM"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    whole = ("ln_", "c_proj.bias", "wpe")
    replicated = sum(p.numel() for n, p in model.named_parameters() if any(w in n for w in whole))
    kv_rows = 40 * 2 * 128 * (6144 + 1)  # k and v of c_attn, weight and bias, per layer
    total = 0
    for rank in range(tp):
        with tp_context(rank, tp):
            total += numel(build_model(engine_cfg(tp), hf, torch.device("meta")))
    assert total == numel(model) + (tp - 1) * (replicated + kv_rows)
    assert_refused(hf, 5, ("'transformer.h.0.attn.c_attn.weight'", "[6400, 6144]", "tp=5",
                   "attention heads = 48 is not divisible by 5", "tp = 1, 2, 3, 4, 6, 8"))


# Typed in rather than stored config.json files: the sizes of Command R+ (104B, Cohere with
# q/k norms) and Command A (111B, Cohere 2), which give those parameter counts.
COHERE_SIZES = {
    "CohereForCausalLM": dict(hidden_size=12288, intermediate_size=33792, use_qk_norm=True,
                              logit_scale=0.8333333333333334),
    "Cohere2ForCausalLM": dict(hidden_size=12288, intermediate_size=36864, logit_scale=0.25,
                               sliding_window=4096),
}


@pytest.mark.parametrize("arch", sorted(COHERE_SIZES))
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_cohere_shapes_add_up_with_only_the_layer_norms_replicated(arch, tp):
    """96 heads / 8 KV heads of 128, 64 layers, vocabulary 256000, tied head. Every rank
    holds the bias-free LayerNorms whole; q_norm / k_norm (Command R+) split with their
    heads, so the rest adds up to transformers' count exactly. tp = 5 is refused naming
    q_proj."""
    from transformers import AutoModelForCausalLM, Cohere2Config, CohereConfig

    kind = CohereConfig if arch == "CohereForCausalLM" else Cohere2Config
    hf = kind(num_attention_heads=96, num_key_value_heads=8, num_hidden_layers=64,
              vocab_size=256000, architectures=[arch], **COHERE_SIZES[arch])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert 103e9 < numel(model) < 112e9
    whole = ("input_layernorm", "model.norm")
    replicated = sum(p.numel() for n, p in model.named_parameters() if n.startswith(whole)
                     or any(f".{w}." in n for w in whole))
    assert_ranks_add_up(hf, tp, numel(model), replicated)
    assert_refused(hf, 5, ("'model.layers.0.self_attn.q_proj.weight'", "[12288, 12288]", "tp=5",
                   "attention heads = 96 is not divisible by 5", "tp = 1, 2, 4, 8"))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_nemotron_shapes_add_up_with_the_layer_norms_replicated(tp):
    """Minitron-8B's dimensions (48 heads of 128 in a hidden of 4096, 8 KV heads, relu2 MLP
    of 16384, 32 layers, vocabulary 256000, untied), typed in rather than a stored
    config.json. Every rank holds the LayerNorm1P weights and biases whole; the rest adds up
    to transformers' count. tp = 5 is refused naming q_proj (the heads are checked before
    up_proj's 16384 rows, which 5 does not divide either)."""
    from transformers import AutoModelForCausalLM, NemotronConfig

    hf = NemotronConfig(hidden_size=4096, num_attention_heads=48, num_key_value_heads=8,
                        head_dim=128, intermediate_size=16384, num_hidden_layers=32,
                        vocab_size=256000, architectures=["NemotronForCausalLM"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert 8.2e9 < numel(model) < 8.3e9
    replicated = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert_ranks_add_up(hf, tp, numel(model), replicated)
    assert_refused(hf, 5, ("'model.layers.0.self_attn.q_proj.weight'", "[6144, 4096]", "tp=5",
                   "attention heads = 48 is not divisible by 5"))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize(("layers", "experts"), [(24, 32), (36, 128)], ids=["20b", "120b"])
def test_gpt_oss_shapes_add_up_with_the_row_biases_and_router_replicated(layers, experts, tp):
    """gpt-oss-20b's and -120b's dimensions (GptOssConfig's defaults are 120b's: 64 heads of
    64, 8 KV heads, hidden and expert intermediate 2880, vocab 201088; 20b: 24 layers of 32
    experts), typed in rather than stored config.json files. Every rank holds the norms,
    o_proj's bias, the router (weight and bias) and the experts' down bias whole; the rest,
    sinks and the interleaved gate/up bias included, adds up to transformers' count. tp = 3
    is refused naming q_proj (2880 divides by 3, the 64 heads do not)."""
    from transformers import AutoModelForCausalLM, GptOssConfig

    hf = GptOssConfig(num_hidden_layers=layers, num_local_experts=experts,
                      architectures=["GptOssForCausalLM"])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    whole = ("norm", "o_proj.bias", "mlp.router.", "down_proj_bias")
    replicated = sum(p.numel() for n, p in model.named_parameters() if any(w in n for w in whole))
    assert_ranks_add_up(hf, tp, numel(model), replicated)
    assert_refused(hf, 3, ("'model.layers.0.self_attn.q_proj.weight'", "[4096, 2880]", "tp=3",
                   "attention heads = 64 is not divisible by 3"))


# Typed in from the published config.json files' text_config (meta-llama/Llama-4-Scout-17B-16E
# and Llama-4-Maverick-17B-128E, -Instruct alike): 48 layers, hidden 5120, 40 heads / 8 KV
# heads of 128, experts of intermediate 8192 (one per token, a shared expert of the same
# size), vocabulary 202048, untied head. Scout: 16 experts on every layer, L2 qk norm;
# Maverick: 128 experts on every other layer (interleave_moe_layer_step 2, the others dense
# of intermediate_size_mlp 16384), no qk norm. Neither norm has weights to count.
LLAMA4_SIZES = {
    "scout": dict(num_local_experts=16, interleave_moe_layer_step=1, use_qk_norm=True),
    "maverick": dict(num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False),
}


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(LLAMA4_SIZES))
def test_llama4_text_shapes_add_up_with_norms_and_router_replicated(name, tp):
    """Every rank holds the norms and each expert layer's router whole; heads, the experts'
    and the shared expert's intermediate units, the dense layers' and the vocabulary split,
    so the rest adds up to transformers' count of the text model (Scout's about 107.8e9,
    Maverick's about 400.7e9 parameters). tp = 3 is refused naming q_proj."""
    from transformers import AutoModelForCausalLM, Llama4TextConfig

    hf = Llama4TextConfig(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                          num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8,
                          head_dim=128, vocab_size=202048, num_experts_per_tok=1,
                          tie_word_embeddings=False, architectures=["Llama4ForCausalLM"],
                          **LLAMA4_SIZES[name])
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    # The published totals (109e9 and 400e9) include Scout's vision tower of about 1e9.
    assert round(numel(model) / 1e8) == (1078 if name == "scout" else 4007)
    whole = ("norm", "feed_forward.router.")
    replicated = sum(p.numel() for n, p in model.named_parameters() if any(w in n for w in whole))
    assert_ranks_add_up(hf, tp, numel(model), replicated)
    assert_refused(hf, 3, ("'model.layers.0.self_attn.q_proj.weight'", "[5120, 5120]", "tp=3",
                   "attention heads = 40 is not divisible by 3"))


# Typed in rather than stored config.json files: Falcon-7B (multi-query, 71 heads of 64),
# Falcon-40B and Falcon-180B (new_decoder_architecture, 8 KV heads), with their counts.
FALCON_SIZES = {
    "7b": (dict(hidden_size=4544, num_attention_heads=71, num_hidden_layers=32,
                multi_query=True, parallel_attn=True), 6.5e9, 7.5e9, [1]),
    "40b": (dict(hidden_size=8192, num_attention_heads=128, num_kv_heads=8,
                 num_hidden_layers=60, new_decoder_architecture=True), 40e9, 43e9, [1, 2, 4, 8]),
    "180b": (dict(hidden_size=14848, num_attention_heads=232, num_kv_heads=8,
                  num_hidden_layers=80, new_decoder_architecture=True), 175e9, 182e9,
             [1, 2, 4, 8]),
}


@pytest.mark.parametrize("name", sorted(FALCON_SIZES))
def test_falcon_shapes_add_up_with_only_the_layer_norms_replicated(name):
    """Vocabulary 65024, tied head, no biases: every rank holds the LayerNorms whole, its
    query heads and their KV group's k and v (7B's one KV head on its one rank), so the rest
    adds up to transformers' count at each tp the heads allow; tp = 5 (and for 7B's 71 heads
    tp = 2) is refused naming query_key_value and the tps that work."""
    from transformers import AutoModelForCausalLM, FalconConfig

    sizes, low, high, tps = FALCON_SIZES[name]
    hf = FalconConfig(vocab_size=65024, architectures=["FalconForCausalLM"], **sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    assert low < numel(model) < high
    replicated = sum(p.numel() for n, p in model.named_parameters() if ".ln_" in n
                     or "layernorm" in n or n.startswith("transformer.ln_f"))
    for tp in tps:
        total = 0
        for rank in range(tp):
            with tp_context(rank, tp):
                total += numel(build_model(engine_cfg(tp), hf, torch.device("meta")))
        assert total == numel(model) + (tp - 1) * replicated, tp
    bad, works = (2, "tp = 1 or 71.") if name == "7b" else (5, "tp = 1, 2, 4, 8")
    with pytest.raises(ShardingError) as err:
        check_shardable(engine_cfg(bad), hf)
    heads = sizes["num_attention_heads"]
    for needle in ("'transformer.h.0.self_attention.query_key_value.weight'", f"tp={bad}",
                   f"attention heads = {heads} is not divisible by {bad}", works):
        assert needle in str(err.value), str(err.value)
