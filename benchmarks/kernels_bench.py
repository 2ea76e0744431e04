"""Attention kernels on a GPU: start-up with a cold and a warm Triton cache, and decode-step
times of the triton and torch backends side by side.

    python benchmarks/kernels_bench.py --out results/   # needs CUDA; writes JSON + markdown

Start-up runs in fresh processes (so Triton's in-memory cache is empty) against one fresh
TRITON_CACHE_DIR: the first start compiles every kernel, the second loads them from disk.
Each start builds an in-process (tp = 1, InProcessExecutor) engine on a random Llama (hidden
1024, 4 layers, 8 query / 2 KV heads of 128, bf16) and generates a few tokens.

Kernel tables first (kernel_tables.md, also alone with --part kernels): split-K decode
attention GB/s at batch 1 and 32 for contexts 512/2k/8k against one program per KV head, and
each fused layer kernel against the unfused torch path, and prefill attention of a 2k and an
8k prompt, at Llama-3-8B shapes.

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



def decode_meta(batch: int, ctx: int, dev: torch.device):
    """Metadata of one decode step: `batch` sequences of `ctx` tokens in shuffled blocks."""
    from tpserve.kernels.base import AttentionMetadata

    nb = ctx // BLOCK
    perm = torch.randperm(batch * nb, device=dev, dtype=torch.int32)
    return AttentionMetadata(
        torch.arange(batch + 1, dtype=torch.int32, device=dev),
        torch.full((batch,), ctx, dtype=torch.int32, device=dev), perm.view(batch, nb),
        torch.zeros(batch, dtype=torch.long, device=dev), 1, ctx, (1,) * batch, (ctx,) * batch)

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
    from tpserve.kernels.base import AttentionSpec
    from tpserve.kernels.torch_backend import TorchAttentionBackend
    from tpserve.kernels.triton_backend import TritonAttentionBackend

    dev, dtype = torch.device("cuda"), torch.bfloat16
    spec = AttentionSpec(8, 2, 128, 128**-0.5, block_size=BLOCK)
    nb = ctx // BLOCK
    meta = decode_meta(batch, ctx, dev)
    q = torch.randn(batch, 8, 128, dtype=dtype, device=dev)
    res = {}
    for backend in (TorchAttentionBackend(), TritonAttentionBackend()):
        shape = backend.kv_cache_shape(batch * nb, spec)
        kc, vc = (torch.randn(shape, dtype=dtype, device=dev) for _ in range(2))
        res[backend.name] = time_cuda(lambda b=backend, k=kc, v=vc: b.decode(q, k, v, meta, spec))
    # Bytes the kernel must read: every key and value of every sequence once.
    res["kv_bytes"] = 2 * batch * ctx * 2 * 128 * 2
    return res


# Llama-3-8B's attention and MLP shapes, bf16: the kernel tables below.
L3_HEADS, L3_KV, L3_D, L3_HIDDEN, L3_INTER = 32, 8, 128, 4096, 14336
SPLIT_BATCHES, SPLIT_CONTEXTS = (1, 32), (512, 2048, 8192)
FUSED_TOKENS = (1, 32, 256)
PREFILL_TOKENS = (2048, 8192)
# Prefill tiles tried against the default (64 rows, 4 warps, 2 stages): rows, warps, stages.
PREFILL_TILES = (None, (128, 8, 2), (128, 8, 3), (64, 4, 3))
TABLE_DEVICE = "cuda"  # a dry run of the table code may set "cpu" (TRITON_INTERPRET=1)


def time_loop(fn, n: int = 100) -> float:
    """Mean milliseconds of fn() over n back-to-back launches (CUDA events around the loop)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n


def _split_row(split, single, spec, batch: int, ctx: int) -> dict:

    dev, dtype = torch.device(TABLE_DEVICE), torch.bfloat16
    nb = ctx // BLOCK
    meta = decode_meta(batch, ctx, dev)
    q = torch.randn(batch, L3_HEADS, L3_D, dtype=dtype, device=dev)
    shape = split.kv_cache_shape(batch * nb, spec)
    kc, vc = (torch.randn(shape, dtype=dtype, device=dev) for _ in range(2))
    kv_bytes = 2 * batch * ctx * L3_KV * L3_D * 2
    row = {"batch": batch, "context": ctx, "splits": split.num_splits(dev, batch, spec),
           "kv_bytes": kv_bytes}
    for label, be in (("split", split), ("single", single)):
        ms = time_cuda(lambda be=be: be.decode(q, kc, vc, meta, spec))
        row[f"{label}_ms"], row[f"{label}_gbs"] = ms, kv_bytes / ms / 1e6
    torch.testing.assert_close(split.decode(q, kc, vc, meta, spec),
                               single.decode(q, kc, vc, meta, spec), atol=2e-2, rtol=0)
    return row


def split_k_table() -> list[dict]:
    """Decode attention of one layer, Llama-3-8B heads: split-K (the default) against one
    program per (sequence, KV head) (TPSERVE_DECODE_SPLITS=1). GB/s counts the K and V bytes
    the step must read once."""
    from tpserve.kernels.base import AttentionSpec
    from tpserve.kernels.triton_backend import TritonAttentionBackend

    spec = AttentionSpec(L3_HEADS, L3_KV, L3_D, L3_D**-0.5, block_size=BLOCK)
    split = TritonAttentionBackend()
    single = TritonAttentionBackend()
    single.forced_splits = 1
    rows = []
    for batch in SPLIT_BATCHES:
        for ctx in SPLIT_CONTEXTS:
            rows.append(_split_row(split, single, spec, batch, ctx))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    return rows


def prefill_table() -> list[dict]:
    """One long prompt through the prefill kernel, Llama-3-8B heads (GQA 4:1, each key tile
    read once per group): milliseconds and TFLOP/s of the causal attention arithmetic."""
    from tpserve.kernels.base import AttentionMetadata, AttentionSpec
    from tpserve.kernels.triton_backend import TritonAttentionBackend

    dev, dtype = torch.device(TABLE_DEVICE), torch.bfloat16
    spec = AttentionSpec(L3_HEADS, L3_KV, L3_D, L3_D**-0.5, block_size=BLOCK)
    backend = TritonAttentionBackend()
    rows = []
    for t in PREFILL_TOKENS:
        nb = t // BLOCK
        meta = AttentionMetadata(
            torch.tensor([0, t], dtype=torch.int32, device=dev),
            torch.tensor([t], dtype=torch.int32, device=dev),
            torch.randperm(nb, device=dev, dtype=torch.int32).view(1, nb),
            torch.zeros(t, dtype=torch.long, device=dev), t, t, (t,), (t,))
        q = torch.randn(t, L3_HEADS, L3_D, dtype=dtype, device=dev)
        kc, vc = (torch.randn(backend.kv_cache_shape(nb, spec), dtype=dtype, device=dev)
                  for _ in range(2))
        flops = 4 * (t * t / 2) * L3_D * L3_HEADS  # QK^T and PV over the causal half
        ref = backend.prefill(q, kc, vc, meta, spec)
        for tile in PREFILL_TILES:  # the default first, then candidates for a new default
            try:
                _prefill_with(backend, q, kc, vc, meta, spec, tile)
            except Exception as exc:  # noqa: BLE001 - a candidate that fails is a table row
                rows.append({"tokens": t, "tile": tile, "ms": float("nan"),
                             "tflops": float("nan"), "max_abs_diff_vs_default": float("nan"),
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                print(json.dumps(rows[-1]), flush=True)
                continue
            ms = time_cuda(lambda q=q, kc=kc, vc=vc, meta=meta, tile=tile: _prefill_with(
                backend, q, kc, vc, meta, spec, tile), iters=10)
            out = _prefill_with(backend, q, kc, vc, meta, spec, tile)
            err = (out.float() - ref.float()).abs().max().item()
            rows.append({"tokens": t, "tile": tile or "default", "ms": ms,
                         "tflops": flops / ms / 1e9, "max_abs_diff_vs_default": err})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _prefill_with(backend, q, kc, vc, meta, spec, tile):
    """backend.prefill, or the same launch with (rows per tile, num_warps, num_stages)."""
    backend.prefill_tile = tile
    try:
        return backend.prefill(q, kc, vc, meta, spec)
    finally:
        backend.prefill_tile = None


def _fused_rows(t: int) -> list[dict]:
    import torch.nn.functional as F

    from tpserve.kernels import fused_ops as fo
    from tpserve.kernels.torch_backend import TorchAttentionBackend

    dev, dtype = torch.device(TABLE_DEVICE), torch.bfloat16
    torch_backend = TorchAttentionBackend()
    w = torch.randn(L3_HIDDEN, dtype=dtype, device=dev)
    kc, vc = (torch.zeros(4096, BLOCK, L3_KV, L3_D, dtype=dtype, device=dev) for _ in range(2))
    x, r = (torch.randn(t, L3_HIDDEN, dtype=dtype, device=dev) for _ in range(2))
    gu = torch.randn(t, 2 * L3_INTER, dtype=dtype, device=dev)
    qkv = torch.randn(t, (L3_HEADS + 2 * L3_KV) * L3_D, dtype=dtype, device=dev)
    q, k, v = (y.view(t, -1, L3_D) for y in qkv.split(
        [L3_HEADS * L3_D, L3_KV * L3_D, L3_KV * L3_D], -1))
    ang = torch.rand(t, L3_D // 2, device=dev) * 100
    cos, sin = (torch.cat([f(ang)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    slots = torch.randperm(4096 * BLOCK, device=dev)[:t]

    def torch_rotary():
        torch_backend.write_kv(fo.apply_rotary_torch(k, cos, sin), v, kc, vc, slots)
        return fo.apply_rotary_torch(q, cos, sin)

    cases = {
        "add_rms_norm": (lambda: fo.add_rms_norm_triton(x, r, w, 1e-5),
                         lambda: fo.add_rms_norm_torch(x, r, w, 1e-5)),
        "silu_and_mul": (lambda: fo.gated_act_triton(gu, False),
                         lambda: fo.gated_act_torch(gu, F.silu)),
        "rotary_write_kv": (lambda: fo.rotary_write_kv_triton(q, k, v, cos, sin, kc, vc, slots),
                            torch_rotary),
    }
    return [{"kernel": name, "tokens": t, "fused_ms": time_loop(fused),
             "torch_ms": time_loop(unfused)} for name, (fused, unfused) in cases.items()]


def fused_table() -> list[dict]:
    """Each fused kernel against the unfused torch path it replaces, Llama-3-8B shapes."""
    rows = []
    for t in FUSED_TOKENS:
        rows += _fused_rows(t)
        print(json.dumps(rows[-3:]), flush=True)
    return rows


def kernel_tables_md(split_rows: list[dict], fused_rows: list[dict],
                     prefill_rows: list[dict]) -> str:
    dev = torch.cuda.get_device_name()
    lines = [f"Machine: 1x {dev}, torch {torch.__version__}, triton "
             f"{__import__('triton').__version__}; {datetime.date.today()}.", "",
             f"Split-K decode attention, one layer ({L3_HEADS} query / {L3_KV} KV heads x "
             f"{L3_D}, bf16, block {BLOCK}), median of 50 (CUDA events); GB/s = K and V bytes "
             "read / time:", "",
             "| batch | context | splits | split-K (ms) | split-K GB/s | one program per KV "
             "head (ms) | its GB/s | speed-up |", "| --- | --- | --- | --- | --- | --- | --- "
             "| --- |"]
    for r in split_rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['splits']} | {r['split_ms']:.3f} | "
                     f"{r['split_gbs']:.0f} | {r['single_ms']:.3f} | {r['single_gbs']:.0f} | "
                     f"{r['single_ms'] / r['split_ms']:.1f}x |")
    lines += ["", f"Fused layer kernels against the unfused torch path, Llama-3-8B shapes "
              f"(hidden {L3_HIDDEN}, intermediate {L3_INTER}), bf16, mean of 100 launches:", "",
              "| kernel | tokens | fused (ms) | torch (ms) | speed-up |",
              "| --- | --- | --- | --- | --- |"]
    for r in fused_rows:
        lines.append(f"| {r['kernel']} | {r['tokens']} | {r['fused_ms']:.4f} | "
                     f"{r['torch_ms']:.4f} | {r['torch_ms'] / r['fused_ms']:.1f}x |")
    lines += ["", "Prefill attention of one prompt, one layer (same heads, GQA 4:1), median of "
              "10; TFLOP/s of the causal QK^T and PV arithmetic:", "",
              "| prompt tokens | tile (rows, warps, stages) | ms | TFLOP/s | max diff vs "
              "default |", "| --- | --- | --- | --- | --- |"]
    for r in prefill_rows:
        lines.append(f"| {r['tokens']} | {r['tile']} | {r['ms']:.3f} | {r['tflops']:.0f} | "
                     f"{r['max_abs_diff_vs_default']:.1e} |")
    return "\n".join(lines)


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
    ap.add_argument("--part", choices=("all", "kernels"), default="all",
                    help="kernels: only the split-K and fused-kernel tables (no engine)")
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
    split_rows, fused_rows, prefill_rows = split_k_table(), fused_table(), prefill_table()
    (args.out / "kernel_tables.json").write_text(json.dumps(
        {"split_k": split_rows, "fused": fused_rows, "prefill": prefill_rows}, indent=1))
    tables = kernel_tables_md(split_rows, fused_rows, prefill_rows)
    (args.out / "kernel_tables.md").write_text(tables + "\n")
    print(tables, flush=True)
    if args.part == "kernels":
        return 0
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
