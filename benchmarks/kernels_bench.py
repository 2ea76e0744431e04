"""Attention kernels on a GPU: start-up with a cold and a warm Triton cache, and decode-step
times of the triton and torch backends side by side.

    python benchmarks/kernels_bench.py --out results/   # needs CUDA; writes JSON + markdown

Start-up runs in fresh processes (so Triton's in-memory cache is empty) against one fresh
TRITON_CACHE_DIR: the first start compiles every kernel, the second loads them from disk.
Each start builds an in-process (tp = 1, InProcessExecutor) engine on a random Llama (hidden
1024, 4 layers, 8 query / 2 KV heads of 128, bf16) and generates a few tokens.

Decode steps are timed two ways, for batch 1/8/32 and context 512/2048: the attention
kernel alone (one layer, CUDA events) and one whole engine step (Worker.execute: the
4-layer model, sampling and the host-side batch preparation).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

BATCHES = (1, 8, 32)
CONTEXTS = (512, 2048)
BLOCK = 16
STEP_KERNELS = ("torch", "triton")


def make_model(out: Path) -> Path:
    from tiny_models import llama_config, save_model

    cfg = llama_config(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, vocab_size=32000,
                       max_position_embeddings=4096)
    return save_model(cfg, out, vocab_for_tokenizer=300)


def engine_config(path: Path, kernel: str, num_blocks: int):
    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    return EngineConfig(
        model=ModelConfig(path=str(path), model_id="random-llama", dtype="bfloat16",
                          max_model_len=4096),
        parallel=ParallelConfig(tp_size=1, device="cuda"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096),
        kernel=kernel)


def start_once(path: Path, kernel: str) -> dict:
    """One start-up in this process: engine construction (load, cache, warmup) timed."""
    from engine_utils import greedy

    from tpserve.engine.engine import Engine
    from tpserve.executor.inprocess import InProcessExecutor

    t0 = time.perf_counter()
    cfg = engine_config(path, kernel, 512)
    engine = Engine(cfg, InProcessExecutor(cfg))
    started = time.perf_counter() - t0
    tokens = greedy(engine, ["The quick brown fox", "Hello"], 8)
    backend = engine.executor.worker.backend
    reports = [r.__dict__ for r in getattr(backend, "reports", [])]
    health = engine.executor.health()[0]
    engine.shutdown()
    return {"kernel": kernel, "start_s": started, "warmup_s": engine.warmup_seconds,
            "variants": sum(r["variants"] for r in reports),
            "compiled_from_source": sum(r["compiled_from_source"] for r in reports),
            "compiles_since_warmup": health["compiles_since_warmup"], "tokens": tokens}


def startup(path: Path, cache_dir: Path) -> list[dict]:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir))
    runs = []
    for label, kernel in (("triton, cold cache", "triton"), ("triton, warm cache", "triton"),
                          ("torch", "torch")):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--start-once", str(path), kernel],
                              env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-4000:])
        run = json.loads(proc.stdout.strip().splitlines()[-1])
        run.update(label=label, process_s=time.perf_counter() - t0)
        runs.append(run)
        print(json.dumps(run), flush=True)
    return runs


def time_cuda(fn, iters: int = 50) -> float:
    """Median milliseconds of fn() over iters, after warm-up, by CUDA events."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def attention_only(batch: int, ctx: int) -> dict:
    from tpserve.kernels.base import AttentionMetadata, AttentionSpec
    from tpserve.kernels.torch_backend import TorchAttentionBackend
    from tpserve.kernels.triton_backend import TritonAttentionBackend

    dev, dtype = torch.device("cuda"), torch.bfloat16
    spec = AttentionSpec(8, 2, 128, 128**-0.5, block_size=BLOCK)
    nb = ctx // BLOCK
    perm = torch.randperm(batch * nb, device=dev, dtype=torch.int32)
    meta = AttentionMetadata(
        torch.arange(batch + 1, dtype=torch.int32, device=dev),
        torch.full((batch,), ctx, dtype=torch.int32, device=dev), perm.view(batch, nb),
        torch.zeros(batch, dtype=torch.long, device=dev), 1, ctx, (1,) * batch, (ctx,) * batch)
    q = torch.randn(batch, 8, 128, dtype=dtype, device=dev)
    res = {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        shape = backend.kv_cache_shape(batch * nb, spec)
        kc, vc = (torch.randn(shape, dtype=dtype, device=dev) for _ in range(2))
        res[backend.name] = time_cuda(lambda b=backend, k=kc, v=vc: b.decode(q, k, v, meta, spec))
    # Bytes the kernel must read: every key and value of every sequence once.
    res["kv_bytes"] = 2 * batch * ctx * 2 * 128 * 2
    return res


def engine_steps(path: Path) -> dict:
    """Whole decode steps through Worker.execute, for both backends."""
    from tpserve.engine.request import SamplingParams
    from tpserve.engine.step import SeqStep, StepBatch
    from tpserve.executor.inprocess import InProcessExecutor
    from tpserve.kernels.compile_cache import warmup_batch_sizes

    need = max(BATCHES) * max(CONTEXTS) // BLOCK
    out: dict = {}
    for kernel in STEP_KERNELS:
        ex = InProcessExecutor(engine_config(path, kernel, need))
        ex.start()
        ex.allocate_cache(need)
        ex.warmup(warmup_batch_sizes(32))
        params = SamplingParams(max_new_tokens=1)
        for b in BATCHES:
            for c in CONTEXTS:
                nb = c // BLOCK
                batch = StepBatch(0, [SeqStep(i, [5], c - 1, list(range(i * nb, (i + 1) * nb)),
                                              True, params) for i in range(b)])
                for _ in range(3):
                    ex.execute_step(batch)
                t0 = time.perf_counter()
                n = 20
                for _ in range(n):
                    ex.execute_step(batch)  # returns host tokens: each step ends synchronised
                out[f"{kernel} b={b} ctx={c}"] = (time.perf_counter() - t0) / n * 1e3
        out[f"{kernel} compiles_since_warmup"] = ex.health()[0]["compiles_since_warmup"]
        ex.shutdown()
        torch.cuda.empty_cache()
    return out


def markdown(start: list[dict], attn: dict, steps: dict) -> str:
    dev = torch.cuda.get_device_name()
    lines = [f"Machine: 1x {dev}, torch {torch.__version__}, triton "
             f"{__import__('triton').__version__}; {datetime.date.today()}.", "",
             "| start-up | engine start (s) | warmup (s) | kernel variants | compiled from "
             "source | compiles while serving |", "| --- | --- | --- | --- | --- | --- |"]
    for r in start:
        lines.append(f"| {r['label']} | {r['start_s']:.2f} | {r['warmup_s']:.2f} | "
                     f"{r['variants']} | {r['compiled_from_source']} | "
                     f"{r['compiles_since_warmup']} |")
    lines += ["", "Decode attention, one layer (8 query / 2 KV heads x 128, bf16, block 16), "
              "median of 50 (CUDA events):", "",
              "| batch | context | torch (ms) | triton (ms) | speed-up | triton GB/s |",
              "| --- | --- | --- | --- | --- | --- |"]
    for (b, c), r in attn.items():
        lines.append(f"| {b} | {c} | {r['torch']:.3f} | {r['triton']:.3f} | "
                     f"{r['torch'] / r['triton']:.1f}x | {r['kv_bytes'] / r['triton'] / 1e6:.0f} |")
    lines += ["", "Whole decode step (4-layer model, Worker.execute incl. host-side "
              "preparation and sampling), mean of 20:", "",
              "| batch | context | torch (ms) | triton (ms) |", "| --- | --- | --- | --- |"]
    for b in BATCHES:
        for c in CONTEXTS:
            lines.append(f"| {b} | {c} | {steps[f'torch b={b} ctx={c}']:.2f} | "
                         f"{steps[f'triton b={b} ctx={c}']:.2f} |")
    lines.append(f"\nCompiles while serving the step benchmark: torch "
                 f"{steps['torch compiles_since_warmup']}, triton "
                 f"{steps['triton compiles_since_warmup']}.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--start-once", nargs=2, metavar=("MODEL", "KERNEL"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.start_once:
        print(json.dumps(start_once(Path(args.start_once[0]), args.start_once[1])))
        return 0
    if not torch.cuda.is_available():
        print("kernels_bench needs a CUDA device", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tpserve-bench-"))
    path = make_model(work / "llama")
    start = startup(path, work / "triton-cache")
    attn = {(b, c): attention_only(b, c) for b in BATCHES for c in CONTEXTS}
    print(json.dumps({str(k): v for k, v in attn.items()}), flush=True)
    steps = engine_steps(path)
    print(json.dumps(steps), flush=True)
    (args.out / "kernels_bench.json").write_text(json.dumps(
        {"startup": start, "attention": {str(k): v for k, v in attn.items()}, "steps": steps},
        indent=1))
    md = markdown(start, attn, steps)
    (args.out / "kernels_bench.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
