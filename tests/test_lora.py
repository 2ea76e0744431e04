"""Multi-LoRA serving against transformers + peft in float32 on the CPU: two adapters and the
base model in the same batch at tp 1, 2 and 4 (the tiny Llama has 4 query heads and 2 KV
heads, so tp 4 replicates KV heads), adapter b with rsLoRA, another rank and a subset of
target modules; oracle guards show that the checks can fail."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_utils import assert_close_rel, make_engine
from lora_utils import (
    NAMES,
    NEW,
    PROMPTS,
    engine_greedy,
    engine_logits,
    lora_config,
    mixed,
    mixed_oracle,
    oracle_greedy,
    oracle_logits,
    save_adapter,
    two_adapters,
)

from tpserve.config import LoraConfig

REL = 1e-4


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    return two_adapters(llama_dir, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def oracle(llama_dir, adapters):
    """name -> (last-position logits, greedy tokens) of every prompt."""
    return mixed_oracle(llama_dir, adapters)


def check_mixed_batch(engine, oracle) -> None:
    reqs = mixed()
    for (i, name), got in zip([(i, n) for i in range(len(PROMPTS)) for n in NAMES],
                              engine_logits(engine, reqs), strict=True):
        assert_close_rel(got, oracle[name][0][i], REL)
    tokens = engine_greedy(engine, reqs, NEW)
    want = [oracle[n][1][i] for i in range(len(PROMPTS)) for n in NAMES]
    assert tokens == want


def run_tp(llama_dir, adapters, oracle, tp: int, **kw) -> None:
    engine = make_engine(llama_dir, tp, local=tp == 1, forked=tp > 1, lora=lora_config(adapters, **kw))
    try:
        check_mixed_batch(engine, oracle)
    finally:
        engine.shutdown()


def test_oracle_guard_adapters_change_outputs(oracle):
    """Each adapter's logits and tokens differ from the base model's, and from each other's,
    so a server ignoring the adapter (or applying the wrong one) fails the checks below."""
    for i in range(len(PROMPTS)):
        for x, y in (("a", None), ("b", None), ("a", "b")):
            err = (oracle[x][0][i] - oracle[y][0][i]).abs().max().item()
            assert err > 100 * REL * oracle[y][0][i].abs().max().item()
    for name in ("a", "b"):
        assert oracle[name][1] != oracle[None][1]


def test_mixed_batch_tp1(llama_dir, adapters, oracle):
    run_tp(llama_dir, adapters, oracle, 1)


def test_one_adapter_per_step_same_outputs(llama_dir, adapters, oracle):
    """--max-loras 1: adapters take turns (the scheduler), the outputs do not change."""
    engine = make_engine(llama_dir, 1, local=True, lora=lora_config(adapters, max_loras=1))
    seen: list[set[int]] = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        seen.append({s.seq.adapter for s in out} - {0})
        return out

    engine.scheduler.schedule = spy
    try:
        tokens = engine_greedy(engine, mixed(), NEW)
    finally:
        engine.shutdown()
    assert tokens == [oracle[n][1][i] for i in range(len(PROMPTS)) for n in NAMES]
    assert max(len(s) for s in seen) == 1
    assert set().union(*seen) == {1, 2}  # guard: both adapters did run


def test_oracle_guard_rslora_scale(llama_dir, adapters, oracle, tmp_path):
    """Adapter b read with lora_alpha / r (no rsLoRA) gives other logits than tpserve's:
    a server ignoring use_rslora would fail test_mixed_batch."""
    plain = shutil.copytree(adapters["b"], tmp_path / "b_plain")
    cfg = json.loads((plain / "adapter_config.json").read_text())
    cfg["use_rslora"] = False
    (plain / "adapter_config.json").write_text(json.dumps(cfg))
    wrong = oracle_logits(llama_dir, plain, PROMPTS)
    for w, right in zip(wrong, oracle["b"][0], strict=True):
        assert (w - right).abs().max().item() > 100 * REL * right.abs().max().item()


@pytest.mark.slow
def test_mixed_batch_tp2(llama_dir, adapters, oracle):
    run_tp(llama_dir, adapters, oracle, 2)


@pytest.mark.slow
def test_mixed_batch_tp4_replicated_kv_heads(llama_dir, adapters, oracle):
    """4 query heads, 2 KV heads: at tp 4 each KV head (and its rows of the adapters' k and
    v B) is on two ranks."""
    run_tp(llama_dir, adapters, oracle, 4)


def test_prefix_cache_is_per_adapter(llama_dir, adapters, oracle):
    """A prefix cached by the base model is not reused by an adapter's request, nor one
    cached under an adapter by the base model or another adapter; each reuses its own."""
    engine = make_engine(llama_dir, 1, local=True, prefix_caching=True,
                         lora=lora_config(adapters))
    try:
        blocks = engine.scheduler.blocks
        prompt = PROMPTS[2]  # 10 tokens: two full blocks of 4 can be reused

        def run(name):
            before = blocks.hits
            got = engine_logits(engine, [(prompt, name)])[0]
            assert_close_rel(got, oracle[name][0][2], REL)
            return blocks.hits - before

        assert run("a") == 0
        assert run(None) == 0  # a's blocks are not the base model's
        assert run("b") == 0
        assert run("a") == 2  # guard: the cache does serve a request of the same adapter
        assert run(None) == 2
        assert run("b") == 2
    finally:
        engine.shutdown()


def test_unknown_adapter_refused(llama_dir, adapters):
    from tpserve.engine.request import SamplingParams
    from tpserve.errors import ValidationError

    engine = make_engine(llama_dir, 1, local=True, lora=lora_config(adapters))
    try:
        with pytest.raises(ValidationError, match="unknown LoRA adapter 'c'.*'a', 'b'"):
            engine.add_request(PROMPTS[0], SamplingParams(adapter="c"))
    finally:
        engine.shutdown()


def test_sharded_slices_sum_to_the_whole(llama_dir, adapters):
    """Each rank's A and B slices (tp 2) put back together are the adapter's scaled
    product B A per module: column layers split B's rows, row layers A's columns."""
    from safetensors.torch import load_file

    from tpserve.config import EngineConfig, ModelConfig, ParallelConfig
    from tpserve.distributed import tp_context
    from tpserve.weights import load_hf_config
    from tpserve.worker.build import build_model
    from tpserve.worker.lora_loader import attach_adapters

    cfg = lora_config(adapters)
    full = load_file(str(adapters["a"] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.{}.lora_{}.weight"
    deltas = {}
    for rank in range(2):
        ecfg = EngineConfig(model=ModelConfig(path=str(llama_dir), model_id="t"),
                            parallel=ParallelConfig(tp_size=2))
        with tp_context(rank, 2):
            model = build_model(ecfg, load_hf_config(llama_dir), torch.device("cpu"))
            attach_adapters(model, cfg, torch.float32, torch.device("cpu"))
        layer = model.model.layers[0]
        down = layer.mlp.down_proj.lora
        deltas.setdefault("down", []).append(down.b[0] @ down.a[0])  # [out, in_rank]
        qkv = layer.self_attn.qkv_proj.lora
        deltas.setdefault("qkv", []).append(qkv.b[0] @ qkv.a[0])  # [q+k+v rows, in]
    scale = 8 / 4
    want_down = full[key.format("mlp.down_proj", "B")] @ full[key.format("mlp.down_proj", "A")]
    torch.testing.assert_close(torch.cat(deltas["down"], 1), want_down * scale)
    want_q = full[key.format("self_attn.q_proj", "B")] @ full[key.format("self_attn.q_proj", "A")]
    rows_q = [d[:32] for d in deltas["qkv"]]  # 2 of 4 heads of 16 per rank
    torch.testing.assert_close(torch.cat(rows_q, 0), want_q * scale)


def one_adapter_beside_the_base(path, adapter_dir, tp: int) -> None:
    """One adapter and the base model in one batch at tp: prefill logits and greedy tokens
    of both equal transformers (+ peft), and the adapter changes the tokens (oracle guard)."""
    adapter = save_adapter(path, adapter_dir, seed=7, r=4, alpha=8)
    want = {n: (oracle_logits(path, adapter if n else None, PROMPTS),
                oracle_greedy(path, adapter if n else None, PROMPTS, NEW)) for n in (None, "x")}
    assert want["x"][1] != want[None][1], "oracle guard: the adapter must change the tokens"
    engine = make_engine(path, tp, local=tp == 1, forked=tp > 1,
                         lora=LoraConfig(adapters=(("x", str(adapter)),)))
    try:
        reqs = [(p, n) for p in PROMPTS for n in (None, "x")]
        for (p, n), got in zip(reqs, engine_logits(engine, reqs), strict=True):
            assert_close_rel(got, want[n][0][PROMPTS.index(p)], REL)
        assert engine_greedy(engine, reqs, NEW) == [want[n][1][PROMPTS.index(p)]
                                                   for p, n in reqs]
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_qwen2_biased_qkv_tp2(models_dir, tmp_path):
    """Another Llama-shaped family: Qwen2's q/k/v carry biases (perturbed), which the LoRA
    delta adds to; one adapter and the base model in one batch at tp 2."""
    from tiny_models import family_checkpoint

    one_adapter_beside_the_base(family_checkpoint(models_dir, "qwen2"), tmp_path / "q", 2)


def test_control_message_and_row_groups_carry_the_adapter():
    """Ranks 1..tp-1 learn each sequence's adapter from the control message, and group the
    step's token rows by it (slot = adapter - 1; base rows in no group)."""
    from tpserve.engine.step import SeqStep, StepBatch
    from tpserve.layers.lora import step_groups
    from tpserve.worker.control import decode_step, encode_step

    seqs = [SeqStep(i, [1] * n, 0, [i], True, adapter=a)
            for i, (n, a) in enumerate([(3, 2), (1, 0), (2, 1), (1, 2)])]
    back = decode_step(encode_step(StepBatch(7, seqs)))
    assert [s.adapter for s in back.seqs] == [2, 0, 1, 2]
    groups = step_groups([s.adapter for s in back.seqs], [len(s.token_ids) for s in back.seqs])
    assert [(slot, rows.tolist()) for slot, rows in groups] == [(0, [4, 5]), (1, [0, 1, 2, 6])]


@pytest.mark.parametrize("name", ["cohere-qk-norm", "llama4"])
def test_interleaved_rotary_rows(models_dir, tmp_path, name):
    """Cohere's and Llama 4's q_proj / k_proj rows are held in each head's rotate-half order
    (their interleaved rotary, layers/interleaved_rotary.py), so an adapter's B rows for
    them are reordered alike; one adapter and the base model in one batch at tp 1."""
    from tiny_models import family_checkpoint

    one_adapter_beside_the_base(family_checkpoint(models_dir, name), tmp_path / "c", 1)
