"""A GPTQ int4 checkpoint served in bfloat16 and float16 on CUDA with the Triton kernels, decode batches of
2-16 rows (1-16 in float16) through the tensor-core GEMV (kernels/quant/triton_mma.py), checked against
transformers running the same model with the dequantized weights in float32 on the CPU.

16-bit logits differ from float32 ones by up to ~1e-2 relative, enough to flip near-ties of a
tiny random model, so the oracle is applied by teacher forcing rather than by comparing
whole continuations: every token the engine chose greedily must be transformers' best at
that position, up to that rounding (its logit within 2% of the top logit's magnitude)."""

from __future__ import annotations

import pytest
import torch
from quant_checkpoints import write_quantized
from tiny_models import PROMPTS, llama_config, save_model

from tpserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from tpserve.engine.engine import Engine
from tpserve.engine.request import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]

# Every projection's output width a multiple of 64 and every group 64 inputs: the shapes the
# tensor-core GEMV takes.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2)


def _engine(path, dtype: str) -> Engine:
    from tpserve.executor.inprocess import InProcessExecutor

    cfg = EngineConfig(model=ModelConfig(path=str(path), model_id="t", dtype=dtype,
                                         max_model_len=256),
                       parallel=ParallelConfig(device="cuda"),
                       cache=CacheConfig(block_size=16, num_blocks=128), kernel="triton")
    return Engine(cfg, InProcessExecutor(cfg))


def _greedy(engine: Engine, prompts: list[str], n: int) -> list[tuple[list[int], list[int]]]:
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    seqs = [engine.add_request(engine.tokenize(p), params) for p in prompts]
    finished = 0
    while finished < len(seqs):
        events, _ = engine.step()
        finished += sum(1 for _, ev in events if ev.finished)
    return [(list(s.prompt_ids), list(s.output_ids)) for s in seqs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_int4_decode_batches_on_the_tensor_cores_match_transformers(models_dir, monkeypatch,
                                                                     dtype):
    from transformers import AutoModelForCausalLM

    from tpserve.kernels.quant import triton_kernel as tk

    used = []
    real = tk._mma_launch

    def counting(x, *args, **kwargs):
        y = real(x, *args, **kwargs)
        if y is not None:
            used.append(x.shape[0])
        return y

    monkeypatch.setattr(tk, "_mma_launch", counting)
    monkeypatch.setattr(tk, "MMA_F16", True)  # the default, whatever TPSERVE_INT4_MMA_F16 says
    src = save_model(llama_config(**SHAPE), models_dir / "int4-gpu-float")
    qdir, ref = write_quantized(src, models_dir / "int4-gpu-gptq", models_dir / "int4-gpu-ref",
                                fmt="gptq", group=64, sym=False)
    prompts = (PROMPTS * 3)[:12]  # decode steps of 12 rows (bucket 16), then fewer
    engine = _engine(qdir, dtype)
    try:
        runs = (_greedy(engine, prompts, 16) + _greedy(engine, prompts[:3], 16)
                + _greedy(engine, prompts[:1], 8))  # one-row decode steps too
    finally:
        engine.executor.shutdown()
    # rows 2-16 took the new kernel, and in float16 one row too (bfloat16's stays on the GEMV)
    fewest = tk.MMA_MIN_ROWS[getattr(torch, dtype)]
    assert used and max(used) > 8 and min(used) == fewest, (fewest, used)
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    for prompt_ids, out_ids in runs:
        ids = torch.tensor([prompt_ids + out_ids])
        with torch.no_grad():
            logits = model(ids).logits[0]
        for j, tok in enumerate(out_ids):
            row = logits[len(prompt_ids) + j - 1]
            gap = (row.max() - row[tok]).item()
            assert gap <= 2e-2 * row.abs().max().item(), (
                f"step {j}: chose {tok} ({row[tok]:.4f}), transformers' best "
                f"{row.argmax().item()} ({row.max():.4f})")
