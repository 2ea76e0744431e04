"""Mixed steps (decode rows plus one new prompt) of the in-process engine, with the graph
pieces (worker/piecewise.py) and eagerly, side by side in one process: ms per step.

Every timed step admits one request of --prompt tokens that asks for one new token, so each
step prefills one prompt next to the --decode running sequences, as a server does when a
request arrives while others stream. The pieces are switched off and on between rounds
(the model runner's `pieces`), alternating, on the same engine and cache.

On the GPU machine (Llama-3-8B shape, random bf16 weights):
    python benchmarks/mixed_step.py --decode 1 32 128 --prompt 32 128 384
On the CPU (checks the script; the pieces are CUDA only, so both rows run eagerly there):
    python benchmarks/mixed_step.py --device cpu --model DIR --decode 2 --prompt 8 --steps 3
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from engine_step import build_engine, commit, fill  # noqa: E402
from gpu_engine import make_model_dir  # noqa: E402
from report import emit  # noqa: E402


def mixed_steps(engine, prompt: int, steps: int, salt: int) -> list[float]:
    """ms of `steps` steps, each admitting one `prompt`-token request for one token."""
    from tpserve.engine.request import SamplingParams

    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    vocab = min(engine.tokenizer.vocab_size, 250)
    times = []
    for i in range(steps):
        ids = [(11 * (salt + i) + 5 * j) % vocab + 3 for j in range(prompt)]
        engine.add_request(ids, params)
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def profiled(engine, prompt: int, steps: int, device: str) -> tuple[float, float, float]:
    """(wall ms, GPU kernel ms, device-to-host syncs) per mixed step, from torch.profiler:
    what of a step the device is busy for, and what is host time it waits on."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        mixed_steps(engine, prompt, steps, 99_000)
        if device == "cuda":
            torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / steps * 1e3
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total or 0 for e in events
              if str(getattr(e, "device_type", "")).endswith("CUDA")) / 1e3 / steps
    syncs = sum(e.count for e in events if "Memcpy DtoH" in e.key) / steps
    return wall, gpu, syncs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "xpu"])
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--decode", type=int, nargs="+", default=[1, 32, 128],
                    help="running sequences that decode next to each new prompt")
    ap.add_argument("--prompt", type=int, nargs="+", default=[32, 128, 384],
                    help="tokens of the prompt each timed step prefills")
    ap.add_argument("--context", type=int, default=300, help="tokens of each running sequence")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds each way, alternating")
    ap.add_argument("--cpus", type=int, default=1)
    ap.add_argument("--profile", action="store_true",
                    help="also GPU kernel time per step (torch.profiler), each way")
    ap.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    # What build_engine reads from engine_step's arguments.
    args.batches = [max(args.decode) + 2]
    args.no_async_scheduling = args.no_cuda_graphs = False
    args.steps_total = (args.steps + 5) * 2 * args.rounds * len(args.prompt) + 16
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model_dir(Path(tmp) / "llama3-8b")
        args.dummy = args.model is None or not any(model.glob("*.safetensors"))
        saved_steps, args.steps = args.steps, args.steps_total // 3  # room for every step
        engine = build_engine(args, model)
        args.steps = saved_steps
        runner = engine.executor.worker.runner
        pieces = runner.pieces
        print(f"pieces captured for {pieces.buckets if pieces else 'nothing'}"
              + (f" in {pieces.seconds:.2f} s" if pieces else ""), flush=True)
        try:
            for b in args.decode:
                seqs = fill(engine, b, args.context, args.steps_total)
                for p in args.prompt:
                    got: dict[str, list[float]] = {"pieces": [], "eager": []}
                    for r in range(args.rounds):
                        for mode in ("pieces", "eager") if r % 2 == 0 else ("eager", "pieces"):
                            runner.pieces = pieces if mode == "pieces" else None
                            mixed_steps(engine, p, 5, 1000 * r)  # warm
                            got[mode] += mixed_steps(engine, p, args.steps, 1000 * r + 100)
                    med = {m: statistics.median(t) for m, t in got.items()}
                    prof = {}
                    for mode in ("pieces", "eager") if args.profile else ():
                        runner.pieces = pieces if mode == "pieces" else None
                        prof[mode] = profiled(engine, p, 10, args.device)
                    runner.pieces = pieces
                    rows.append((b, p, med["pieces"], med["eager"], prof))
                    print(f"decode {b:4d} + prompt {p:4d}: pieces {med['pieces']:.2f} ms, "
                          f"eager {med['eager']:.2f} ms; profiled (wall, GPU kernels, "
                          f"syncs) {prof}", flush=True)
                for s in seqs:
                    engine.abort(s.seq_id)
        finally:
            engine.shutdown()
    lines = [f"\n### mixed_step.py, {datetime.date.today()}, commit {commit()}", "",
             f"{model if args.model else 'Llama-3-8B shape, random weights'}, {args.device}, "
             f"{args.dtype}, kernel {args.kernel}, running sequences at ~{args.context} "
             f"tokens, median of {args.steps * args.rounds} steps each way", "",
             "| decode rows | prompt tokens | in pieces ms/step | eager ms/step | eager / pieces "
             "| profiled, pieces: wall / GPU kernels ms | profiled, eager: wall / GPU kernels ms |",
             "|" + " --- |" * 7]
    for b, p, pc, eg, prof in rows:
        cols = [f"{prof[m][0]:.2f} / {prof[m][1]:.2f}" if m in prof else "-"
                for m in ("pieces", "eager")]
        lines.append(f"| {b} | {p} | {pc:.2f} | {eg:.2f} | {eg / pc:.2f}x | {cols[0]} | "
                     f"{cols[1]} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
