"""Random PEFT LoRA adapters for the tiny checkpoints, the transformers + peft oracle (float32
on the CPU), and a mixed batch of adapter and base requests through tpserve's engine."""

from __future__ import annotations

from pathlib import Path

import torch

from tpserve.engine.request import SamplingParams

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# The mixed batch of tests/test_lora.py and tests/test_lora_graphs.py: every prompt with the
# base model (None) and adapters a and b (two_adapters).
PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [7, 8, 9], [100, 200, 150, 33, 60, 71, 88, 120, 140, 12]]
NEW = 8
NAMES = (None, "a", "b")


def save_adapter(base: Path, out: Path, seed: int, r: int = 4, alpha: int = 8,
                 targets: tuple[str, ...] = ALL_TARGETS, rslora: bool = False,
                 b_std: float = 0.15, **extra) -> Path:
    """peft's get_peft_model + save_pretrained on the base checkpoint, with B drawn at random
    (peft starts B at zero, which would make the adapter the base model)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     use_rslora=rslora, **extra)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, b_std)
    peft_model.save_pretrained(out)
    return out


def _oracle(base: Path, adapter: Path | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def oracle_logits(base: Path, adapter: Path | None, prompts: list[list[int]]
                  ) -> list[torch.Tensor]:
    """The last position's logits of each prompt: transformers (+ peft's adapter)."""
    model = _oracle(base, adapter)
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p])).logits[0, -1].float() for p in prompts]


def oracle_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], n: int
                  ) -> list[list[int]]:
    model = _oracle(base, adapter)
    outs = []
    for p in prompts:
        with torch.no_grad():
            gen = model.generate(input_ids=torch.tensor([p]), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=2)
        outs.append(gen[0, len(p):].tolist())
    return outs


def engine_logits(engine, requests: list[tuple[list[int], str | None]]) -> list[torch.Tensor]:
    """Prefill logits of every (prompt, adapter) request, all in one step."""
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=1, ignore_eos=True,
                                                 adapter=a)) for p, a in requests]
    _, out = engine.step(return_logits=True)
    assert len(out.tokens) == len(requests), "every prompt should be prefilled in one step"
    row = {t.seq_id: i for i, t in enumerate(out.tokens)}
    while engine.has_work():
        engine.step()
    return [torch.tensor(out.logits[row[s.seq_id]]) for s in seqs]


def engine_greedy(engine, requests: list[tuple[list[int], str | None]], n: int
                  ) -> list[list[int]]:
    """Greedy continuations of every (prompt, adapter) request, run as one batch."""
    seqs = [engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                 adapter=a)) for p, a in requests]
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs]


def two_adapters(base: Path, out: Path) -> dict[str, Path]:
    """a: r = 4 on every projection; b: r = 8, rsLoRA, q, v, up and down only (the fused
    layers hold a zero part)."""
    return {"a": save_adapter(base, out / "a", seed=1, r=4, alpha=8),
            "b": save_adapter(base, out / "b", seed=2, r=8, alpha=16, rslora=True,
                              targets=("q_proj", "v_proj", "up_proj", "down_proj"))}


def mixed_oracle(base: Path, adapters: dict[str, Path]) -> dict:
    """name -> (last-position logits, greedy tokens) of every prompt."""
    return {n: (oracle_logits(base, adapters.get(n), PROMPTS),
                oracle_greedy(base, adapters.get(n), PROMPTS, NEW)) for n in NAMES}


def lora_config(adapters: dict[str, Path], **kw):
    from tpserve.config import LoraConfig

    return LoraConfig(adapters=tuple((n, str(p)) for n, p in adapters.items()), **kw)


def mixed() -> list[tuple[list[int], str | None]]:
    return [(p, n) for p in PROMPTS for n in NAMES]
