"""One decode step of the in-process engine (tp = 1, no Ray, no HTTP): ms per step at a few
batch sizes, and a torch.profiler split of where a step's time goes (GPU kernel time vs wall,
device-to-host syncs per step). Appends a markdown table to --out.

On the GPU machine (Llama-3-8B shape, random bf16 weights, nothing downloaded):
    python benchmarks/engine_step.py --out docs/engine_step.md
On the CPU with a tiny model directory (checks the script itself):
    python benchmarks/engine_step.py --device cpu --model DIR --batches 1 4 --context 40
With LoRA adapters loaded (random, rank 16), every sequence using one, round robin; against
--no-cuda-graphs (the eager adapter step) and --lora-requests none (base rows only):
    python benchmarks/engine_step.py --kernel triton --lora 4 --out docs/engine_step.md
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_engine import make_model_dir  # noqa: E402 - after the path set-up
from lora_adapters import random_adapters  # noqa: E402


def build_engine(args, model: Path, adapters: list[tuple[str, str]] = ()):
    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        LoraConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tpserve.engine.engine import Engine
    from tpserve.executor.inprocess import InProcessExecutor

    max_batch = max(args.batches)
    max_len = args.context + new_tokens(args) + 16
    blocks_per_seq = -(-max_len // 16)
    cfg = EngineConfig(
        model=ModelConfig(path=str(model), model_id=str(model), dtype=args.dtype,
                          max_model_len=max_len,
                          load_format="dummy" if args.dummy else "safetensors"),
        parallel=ParallelConfig(tp_size=1, device=args.device,
                                cpus_per_shard=args.cpus),
        cache=CacheConfig(block_size=16, num_blocks=max_batch * blocks_per_seq + 8),
        scheduler=SchedulerConfig(max_num_seqs=max_batch,
                                  max_num_batched_tokens=max(8192, args.context * 4),
                                  async_scheduling=not args.no_async_scheduling),
        kernel=args.kernel, cuda_graphs=not args.no_cuda_graphs,
        # Scripts that reuse build_engine without LoRA flags (guided_step, mixed_step) have
        # no lora_rank; without adapters the rank is not read.
        lora=LoraConfig(adapters=tuple(adapters),
                        max_rank=max(getattr(args, "lora_rank", 16), 1),
                        max_loras=max(len(adapters), 1)))
    return Engine(cfg, InProcessExecutor(cfg))


def new_tokens(args) -> int:
    """Room for the warm, timed and profiled steps after the prefill."""
    return 3 * args.steps + 10


def fill(engine, batch: int, context: int, new_tokens: int,
         adapters: list[str | None] = (None,)) -> list:
    """`batch` sequences prefilled to `context` tokens, sequence i under adapters[i % len]
    (None: the base model); returns them, ready to decode."""
    from tpserve.engine.request import SamplingParams

    vocab = min(engine.tokenizer.vocab_size, 250)
    seqs = [engine.add_request([(7 * i + j) % vocab + 3 for j in range(context)],
                               SamplingParams(max_new_tokens=new_tokens, ignore_eos=True,
                                              adapter=adapters[i % len(adapters)]))
            for i in range(batch)]
    while any(s.num_computed < len(s.prompt_ids) for s in seqs):
        engine.step()
    return seqs


def timed_steps(engine, n: int) -> dict:
    """Mean ms per step, the median and slowest step, and per step the part spent waiting
    for the device (the engine's own counters; the rest of a step is host work)."""
    wait0 = engine.device_wait_seconds
    times = []
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    mean = (time.perf_counter() - t0) / n * 1e3
    times.sort()
    return {"ms": mean, "median_ms": times[n // 2] * 1e3, "max_ms": times[-1] * 1e3,
            "wait_ms": (engine.device_wait_seconds - wait0) / n * 1e3}


def profile_steps(engine, n: int, device: str) -> dict:
    """GPU kernel time and device-to-host syncs per step, from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(n):
            engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / n * 1e3
    events = prof.key_averages()
    gpu_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events
                 if getattr(e, "device_type", None) is not None
                 and str(e.device_type).endswith("CUDA"))
    # Each device-to-host copy (.item(), .tolist(), .cpu()) waits for the device: one sync.
    syncs = sum(e.count for e in events if "Memcpy DtoH" in e.key)
    kernels = sorted(((e.key, e.count / n, (e.self_device_time_total or 0) / n) for e in events
                      if str(getattr(e, "device_type", "")).endswith("CUDA")
                      and (e.self_device_time_total or 0) > 0), key=lambda k: -k[2])
    return {"wall_ms": wall, "gpu_ms": gpu_us / 1e3 / n, "syncs": syncs / n,
            "kernels": kernels}


def kernel_table(batch: int, kernels: list, top: int) -> list[str]:
    """The kernels that take the most GPU time per step (names shortened)."""
    total = sum(k[2] for k in kernels)
    lines = ["", f"Batch {batch}: the {top} kernels with the most GPU time per step "
             f"(of {total / 1e3:.2f} ms in {sum(k[1] for k in kernels):.0f} launches):", "",
             "| kernel | launches/step | us/step | share |", "| --- | --- | --- | --- |"]
    for name, calls, us in kernels[:top]:
        short = name.replace("|", "/")[:90]
        lines.append(f"| `{short}` | {calls:.1f} | {us:.1f} | {us / total:.1%} |")
    return lines


def _skip_norm(x, residual, weight, eps, offset, cast_before_weight):
    return x, (x if residual is None else residual)


def _skip_attention(self, q, *args, **kwargs):
    return q


def _skip_act(x, name, act):
    return x.narrow(-1, 0, x.shape[-1] // 2)


# What --ablate replaces: (module, attribute, stand-in). Each stand-in launches nothing and
# keeps the shapes, so the rest of the step runs as it would.
ABLATIONS = {
    "norm": [("tpserve.layers.norm", "add_rms_norm", _skip_norm)],
    # A decode step attends through decode_new (rotary, cache write and attention in one
    # launch); mixed steps through forward.
    "attention": [("tpserve.kernels.triton_backend", "TritonAttentionBackend.forward",
                   _skip_attention),
                  ("tpserve.kernels.triton_backend", "TritonAttentionBackend.decode_new",
                   _skip_attention)],
    # The separate rotary + cache-write launch: decode steps make it only with
    # TPSERVE_DECODE_NEW_KV=0.
    "rotary": [("tpserve.kernels.triton_backend", "TritonAttentionBackend.rotary_write_kv",
                _skip_attention)],
    "act": [("tpserve.layers.activation", "gated_act", _skip_act)],
}


def ablate(parts: list[str]) -> None:
    import importlib

    for part in parts:
        for module, attr, stand_in in ABLATIONS[part]:
            owner = importlib.import_module(module)
            *path, name = attr.split(".")
            for p in path:
                owner = getattr(owner, p)
            setattr(owner, name, stand_in)
            print(f"ablated {part}: {module}.{attr} launches nothing (timing only)",
                  flush=True)


def commit() -> str:
    if (ROOT / "COMMIT").exists():  # an exported tree (git archive) names its commit
        return (ROOT / "COMMIT").read_text().strip()
    try:
        return subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       text=True).strip()
    except Exception:  # noqa: BLE001 - outside a checkout
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="model directory (default: Llama-3-8B shape, "
                    "random weights)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "xpu"])
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on accelerators, else "
                    "float32")
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--context", type=int, default=300, help="tokens in each sequence")
    ap.add_argument("--steps", type=int, default=50, help="timed decode steps per batch")
    ap.add_argument("--cpus", type=int, default=1, help="CPU device: threads")
    ap.add_argument("--no-cuda-graphs", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="steps one at a time (default: overlapped, as served)")
    ap.add_argument("--kernel-table", type=int, default=0, metavar="N",
                    help="also list the N kernels with the most GPU time per step")
    ap.add_argument("--out", type=Path, help="append the table to this markdown file")
    ap.add_argument("--tiles", type=Path, help="quantized-matmul tile table (JSON of "
                    "benchmarks/quant_sweep.py) to use instead of triton_tiles.TILES")
    ap.add_argument("--ablate", nargs="+", default=[], choices=sorted(ABLATIONS),
                    help="timing only, outputs are wrong: skip these parts of every layer "
                    "(their kernels are not launched), to see what each costs on the "
                    "step's critical path, where PDL overlaps kernels and a profiler's "
                    "per-kernel times do not add up")
    ap.add_argument("--lora", type=int, default=0, metavar="N",
                    help="load N random LoRA adapters (benchmarks/lora_adapters.py)")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--lora-requests", default="all", choices=["all", "half", "none"],
                    help="with --lora: which sequences use an adapter (round robin over "
                    "them): all, every other one (the rest the base model), or none")
    args = ap.parse_args()
    ablate(args.ablate)
    if args.tiles:
        from tpserve.kernels.quant.triton_tiles import set_tiles, tiles_from_json

        set_tiles(tiles_from_json(args.tiles.read_text()))
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.dummy = args.model is None or not any(args.model.glob("*.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model_dir(Path(tmp) / "llama3-8b")
        adapters = random_adapters(model, args.lora, args.lora_rank, Path(tmp) / "lora")
        names = [n for n, _ in adapters]
        uses = {"all": names, "half": [x for n in names for x in (n, None)],
                "none": []}[args.lora_requests] or [None]
        engine = build_engine(args, model, adapters)
        # As the server does once a replica is built: the start-up objects leave the
        # garbage collector's generations, so full collections do not walk them mid-step.
        from tpserve.engine.heap import freeze_startup_objects

        freeze_startup_objects()
        inner = getattr(engine.executor.worker.model, "model", None)
        folded = getattr(inner, "norms_folded", None)
        print(f"norms folded into the projections (one-row steps): {folded}", flush=True)
        new_kv = getattr(engine.executor.worker.backend, "decode_new_kv", None)
        print(f"decode steps rotate and store their keys in the decode kernel: {new_kv}",
              flush=True)
        rows = []
        try:
            for b in args.batches:
                seqs = fill(engine, b, args.context, new_tokens(args), uses)
                timed_steps(engine, 5)  # warm
                t = timed_steps(engine, args.steps)
                ms = t["ms"]
                prof = profile_steps(engine, min(args.steps, 20), args.device)
                for s in seqs:
                    engine.abort(s.seq_id)
                rows.append((b, t, prof))
                print(f"batch {b:4d}: {ms:7.2f} ms/step ({b / ms * 1e3:8.0f} tokens/s; median "
                      f"{t['median_ms']:.2f}, slowest {t['max_ms']:.2f}, device wait "
                      f"{t['wait_ms']:.2f}); "
                      f"profiled wall {prof['wall_ms']:.2f} ms, GPU kernels "
                      f"{prof['gpu_ms']:.2f} ms, {prof['syncs']:.1f} syncs/step", flush=True)
        finally:
            engine.shutdown()
    lines = [f"\n### engine_step.py, {datetime.date.today()}, commit {commit()}", "",
             f"{model if args.model else 'Llama-3-8B shape, random weights'}, {args.device}, "
             f"{args.dtype}, kernel {args.kernel}, context ~{args.context}, graphs "
             f"{'off' if args.no_cuda_graphs else 'on'}, overlapped steps "
             f"{'off' if args.no_async_scheduling else 'on'}"
             + (f", {args.lora} LoRA adapters of rank {args.lora_rank} loaded, used by "
                f"{args.lora_requests} sequences" if args.lora else ""), "",
             "| batch | ms/step | median / slowest ms | device wait ms/step | tokens/s | "
             "profiled wall ms | GPU kernel ms | host share | D2H syncs/step |",
             "|" + " --- |" * 9]
    for b, t, p in rows:
        ms = t["ms"]
        share = 1 - p["gpu_ms"] / p["wall_ms"] if p["wall_ms"] and p["gpu_ms"] else float("nan")
        lines.append(f"| {b} | {ms:.2f} | {t['median_ms']:.2f} / {t['max_ms']:.2f} | "
                     f"{t['wait_ms']:.2f} | {b / ms * 1e3:.0f} | {p['wall_ms']:.2f} | "
                     f"{p['gpu_ms']:.2f} | {share:.0%} | {p['syncs']:.1f} |")
    if args.kernel_table:
        for b, _, p in rows:
            lines += kernel_table(b, p["kernels"], args.kernel_table)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
