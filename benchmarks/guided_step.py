"""What a guided (structured-output) request costs a decode batch: ms per step of the
in-process engine at a few batch sizes with no guided row and with one, side by side in one
run, and the first guided request's one-off cost (llguidance's tokenizer for the model's
vocabulary, built once per process). A guided row gives up the overlap of its steps with
the next (its mask needs the token just sampled), and its batch computes a mask on the host
and applies it on the device.

On the GPU machine (Llama-3-8B shape, vocabulary 128,256, random bf16 weights):
    python benchmarks/guided_step.py --out docs/benchmarks.md
On the CPU with a tiny model directory (checks the script itself):
    python benchmarks/guided_step.py --device cpu --model DIR --batches 1 4 --steps 10
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

from engine_step import build_engine, commit  # noqa: E402 - after the path set-up
from gpu_engine import make_model_dir  # noqa: E402
from report import emit  # noqa: E402

# Any letters and spaces, long enough never to end: a random model's likeliest tokens are
# mostly other bytes, so the mask forbids most of the vocabulary at every step.
REGEX = "[a-z ]{0,100000}"


def run(engine, batch: int, guided: int, steps: int) -> float:
    """ms per decode step over `steps` steps of `batch` sequences, `guided` of them guided
    (after 10 warm steps; the prefill is not timed)."""
    import torch

    from tpserve.engine.request import GuidedSpec, SamplingParams

    vocab = min(engine.tokenizer.vocab_size, 250)
    prompt = [(7 * j) % vocab + 3 for j in range(32)]  # as engine_step.fill's, 32 tokens
    seqs = [engine.add_request(prompt, SamplingParams(
        max_new_tokens=steps + 40, ignore_eos=True,
        guided=GuidedSpec("regex", REGEX) if i < guided else None)) for i in range(batch)]
    for _ in range(10):
        engine.step()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for s in seqs:
        engine.abort(s.seq_id)
    for _ in range(3):
        engine.step()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="model directory (default: Llama-3-8B shape, "
                    "random weights)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu", "xpu"])
    ap.add_argument("--dtype", help="default: bfloat16 on accelerators, else float32")
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = ap.parse_args()
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.dummy = args.model is None or not any(args.model.glob("*.safetensors"))
    # What engine_step.build_engine reads: room for the prompt and every timed step.
    args.context, args.cpus = 64, 2
    args.no_async_scheduling = args.no_cuda_graphs = False
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_model_dir(Path(tmp) / "llama3-8b")
        engine = build_engine(args, model)
        try:
            t0 = time.perf_counter()
            run(engine, 1, 1, 5)
            first_s = time.perf_counter() - t0
            print(f"first guided request, 5 steps: {first_s:.2f} s", flush=True)
            rows = []
            for r in range(args.rounds):
                for b in args.batches:
                    plain, guided = run(engine, b, 0, args.steps), run(engine, b, 1, args.steps)
                    print(f"round {r} batch {b}: {plain:.2f} / {guided:.2f} ms per step",
                          flush=True)
                    rows.append((b, plain, guided))
        finally:
            engine.shutdown()
    emit([f"\n### guided_step.py, {datetime.date.today()}, commit {commit()}", "",
          f"{model if args.model else 'Llama-3-8B shape, random weights'}, {args.device}, "
          f"{args.dtype}, kernel {args.kernel}; one guided row matches `{REGEX}`. First "
          f"guided request (llguidance's tokenizer built, 5 steps): {first_s:.2f} s.", "",
          "| batch | no guided row, ms/step | one guided row, ms/step | ratio |",
          "| --- | --- | --- | --- |"]
         + [f"| {b} | {p:.2f} | {g:.2f} | {g / p:.2f}x |" for b, p, g in rows], args.out)


if __name__ == "__main__":
    main()
