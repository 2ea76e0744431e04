"""Tensor parallel on GPUs through Ray + NCCL, side by side with tp = 1, in one run:
  1. correctness: a tiny random Llama in float32 at tp = 1 and 2 on CUDA gives the same
     greedy tokens as transformers on the CPU;
  2. speed: the Llama-3-8B shape (random bf16 weights) at tp = 1 and tp = 2.

    python benchmarks/gpu_tp.py --kernel triton --out results.md   (needs 2 GPUs and Ray)
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def engine_for(path: str, tp: int, dtype: str, kernel: str, dummy: bool, max_len: int = 2048,
               graphs: bool = True):
    from tpserve.cluster.engine import Engine
    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    cfg = EngineConfig(
        model=ModelConfig(path=path, model_id=path, dtype=dtype, max_model_len=max_len,
                          load_format="dummy" if dummy else "safetensors"),
        parallel=ParallelConfig(tp_size=tp, device="cuda"),
        cache=CacheConfig(block_size=16, gpu_memory_utilization=0.85),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192), kernel=kernel,
        cuda_graphs=graphs)
    t0 = time.perf_counter()
    engine = Engine(cfg)
    return engine, time.perf_counter() - t0


def main() -> None:
    import ray
    import torch
    from engine_utils import greedy
    from gpu_engine import make_model_dir, measure
    from tiny_models import PROMPTS, hf_greedy, llama_config, save_model

    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="triton")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ray.init(num_gpus=torch.cuda.device_count(), include_dashboard=False, log_to_driver=False)
    lines = [f"### Tensor parallel on {torch.cuda.device_count()}x "
             f"{torch.cuda.get_device_name(0)} through Ray + NCCL "
             f"({datetime.date.today().isoformat()})\n"]
    with tempfile.TemporaryDirectory() as d:
        tiny = save_model(llama_config(), Path(d) / "tiny")
        ref = hf_greedy(tiny, PROMPTS, 32)
        for tp in (1, 2):
            engine, _ = engine_for(str(tiny), tp, "float32", args.kernel, False, 256)
            same = greedy(engine, PROMPTS, 32) == ref
            backend = engine.load_reports[0].backend
            graphs = engine.executor.health()[0]["decode_graphs"]
            engine.shutdown()
            lines.append(f"- tiny Llama, float32, tp = {tp}, backend {backend}, decode graphs "
                         f"{graphs or 'off'}: greedy 32-token continuations of {len(PROMPTS)} "
                         f"prompts identical to transformers (CPU): **{same}**")
        big = make_model_dir(Path(d) / "big")
        rows = []
        for tp, graphs in ((1, False), (1, True), (2, True)):
            engine, startup = engine_for(str(big), tp, "bfloat16", args.kernel, True,
                                         graphs=graphs)
            rows.append({**measure(engine, startup), "graphs": graphs})
            engine.shutdown()
            torch.cuda.empty_cache()
    lines.append("\nLlama-3-8B shape, random bf16 weights, backend "
                 f"{rows[0]['kernel']}, both tp in the same run:\n")
    lines.append("| tp | decode graphs | weights per GPU GB | start-up s | batch 1 ms/step | "
                 "batch 32 tok/s | 256 req x 256/256 tok/s |\n"
                 "| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        lines.append(f"| {r['tp']} | {'on' if r['graphs'] else 'off'} | "
                     f"{r['weights_gb'] / r['tp']:.2f} | {r['startup_s']:.1f} | "
                     f"{r['b1_ms']:.2f} | {r['b32_tok_s']:.0f} | {r['cb256_tok_s']:.0f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    ray.shutdown()


if __name__ == "__main__":
    main()
