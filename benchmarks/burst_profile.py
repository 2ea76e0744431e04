"""A whole burst in the in-process engine (tp = 1, no Ray, no HTTP): N requests of P prompt
and G new tokens added at once, stepped to the end, as the served 256 x 256/256 benchmark
does through HTTP. Prints the burst's tokens/s, its steps split into prefill (or mixed) and
decode-only ones, and with --profile where the device's time went over the whole burst: GPU
kernel time against wall time (the rest is the device waiting for the host) and the kernels
that took most of it. Several --batch-tokens values run one after the other on one engine,
so a prefill chunk size is judged side by side. Appends a markdown section to --out.

On the GPU machine (Llama-3-8B shape, random bf16 weights):
    python benchmarks/burst_profile.py --profile --batch-tokens 4096 8192 --out burst.md
On the CPU with a tiny model directory (checks the script itself):
    python benchmarks/burst_profile.py --device cpu --model DIR --requests 8 --prompt 32 --new 8
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

from engine_step import commit, kernel_table  # noqa: E402 - after the path set-up
from report import emit  # noqa: E402


def build(args, model: Path):
    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tpserve.engine.engine import Engine
    from tpserve.engine.heap import freeze_startup_objects
    from tpserve.executor.inprocess import InProcessExecutor

    max_len = args.prompt + args.new + 16
    cfg = EngineConfig(
        model=ModelConfig(path=str(model), model_id=str(model), dtype=args.dtype,
                          max_model_len=max_len,
                          load_format="dummy" if args.dummy else "safetensors"),
        parallel=ParallelConfig(tp_size=1, device=args.device, cpus_per_shard=args.cpus),
        cache=CacheConfig(block_size=16,
                          num_blocks=args.requests * -(-max_len // 16) + 8,
                          kv_cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.requests,
                                  max_num_batched_tokens=max(args.batch_tokens),
                                  async_scheduling=not args.no_async_scheduling),
        kernel=args.kernel, cuda_graphs=not args.no_cuda_graphs)
    engine = Engine(cfg, InProcessExecutor(cfg))
    freeze_startup_objects()  # as the served engine core does
    return engine


def burst(engine, args, batch_tokens: int, seed: int) -> dict:
    """One burst; per step its wall time and whether it prefilled (the engine's counters)."""
    from tpserve.engine.request import SamplingParams

    engine.scheduler.max_num_batched_tokens = batch_tokens
    params = SamplingParams(max_new_tokens=args.new, ignore_eos=True)
    vocab = min(engine.tokenizer.vocab_size, 1000)
    for i in range(args.requests):
        engine.add_request([(seed + 7 * i + 13 * j) % vocab + 3 for j in range(args.prompt)],
                           params)
    steps, t0 = [], time.perf_counter()
    while engine.has_work():
        pre, t = engine.prefill_steps, time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t, engine.prefill_steps > pre))
    wall = time.perf_counter() - t0
    prefill = [s for s, p in steps if p]
    decode = sorted(s for s, p in steps if not p)
    return {"batch_tokens": batch_tokens, "wall_s": wall,
            "tok_s": args.requests * args.new / wall, "steps": len(steps),
            "prefill_steps": len(prefill), "prefill_s": sum(prefill),
            "decode_steps": len(decode), "decode_s": sum(decode),
            "decode_median_ms": decode[len(decode) // 2] * 1e3 if decode else 0.0}


def profiled(engine, args, batch_tokens: int) -> tuple[dict, dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    with profile(activities=acts) as prof:
        r = burst(engine, args, batch_tokens, seed=99)
        if args.device == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted(((e.key, e.count, e.self_device_time_total or 0) for e in events
                      if str(getattr(e, "device_type", "")).endswith("CUDA")
                      and (e.self_device_time_total or 0) > 0), key=lambda k: -k[2])
    gpu_s = sum(k[2] for k in kernels) / 1e6
    return r, {"gpu_s": gpu_s, "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: Llama-3-8B shape, "
                    "random weights)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "xpu"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=256, help="new tokens per request")
    ap.add_argument("--batch-tokens", type=int, nargs="+", default=[4096],
                    help="tokens per step (--max-batch-tokens); each value runs a burst")
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="one more burst at the first --batch-tokens under torch.profiler")
    ap.add_argument("--top", type=int, default=12, help="kernels listed with --profile")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.dummy = args.model is None
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        model = args.model
        if model is None:
            from gpu_engine import make_model_dir

            model = make_model_dir(Path(d))
        engine = build(args, model)
        burst(engine, args, args.batch_tokens[0], seed=1)  # warm: allocator, first shapes
        rows = [burst(engine, args, bt, seed=2 + i) for i, bt in enumerate(args.batch_tokens)]
        prof = profiled(engine, args, args.batch_tokens[0]) if args.profile else None
    import torch

    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else args.device
    lines = [f"### A {args.requests} x {args.prompt}/{args.new} burst in-process "
             f"({dev}, {datetime.date.today().isoformat()}, commit {commit()}, KV cache "
             f"{args.kv_cache_dtype})", "",
             "| tokens per step | tokens/s | wall s | steps | prefill steps | prefill s | "
             "decode steps | decode s | decode median ms |", "| --- " * 9 + "|"]
    for r in rows:
        lines.append(f"| {r['batch_tokens']} | {r['tok_s']:,.0f} | {r['wall_s']:.2f} | "
                     f"{r['steps']} | {r['prefill_steps']} | {r['prefill_s']:.2f} | "
                     f"{r['decode_steps']} | {r['decode_s']:.2f} | "
                     f"{r['decode_median_ms']:.2f} |")
    if prof is not None:
        r, p = prof
        lines += ["", f"Under torch.profiler ({r['batch_tokens']} tokens per step; the "
                  f"profiler slows the host): wall {r['wall_s']:.2f} s, GPU kernels "
                  f"{p['gpu_s']:.2f} s ({p['gpu_s'] / r['wall_s']:.0%} of the wall), "
                  f"{r['steps']} steps."]
        lines += kernel_table(args.requests, [(k, c / r["steps"], us / r["steps"])
                                              for k, c, us in p["kernels"]], args.top)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
