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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    import ray
    import torch
    from engine_utils import greedy
    from gpu_engine import bench_engine, make_model_dir, measure
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
            engine, _ = bench_engine(str(tiny), tp, "float32", args.kernel, False, 256)
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
            engine, startup = bench_engine(str(big), tp, "bfloat16", args.kernel, True,
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
