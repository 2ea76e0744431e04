"""Which CUDA path serves a longrope model unlike transformers (2026-12-05: the GPU test
`test_captured_graphs_serve_longrope_past_the_original_context_on_cuda` failed on an H200,
both with and without overlapped steps, while the CPU runs of the same model match: the
Triton attention backend under Triton's interpreter, the norm fold, decode graphs and
piecewise graphs replayed as recorded op graphs).

Runs the test's tiny Phi-3 (longrope over an original context of 32; prompts of 10 tokens,
which crosses while decoding, and 45, long from the start) in one fresh process per
variant and prints, per prompt, the first greedy token that differs from transformers
(float32, CPU), with the prompts served together and alone:

    python scripts/longrope_cuda_diagnose.py            # on the GPU machine
    python scripts/longrope_cuda_diagnose.py --device cpu --variants torch-eager

Variants: the Triton backend with decode graphs (what the test runs), without graphs,
without the norm fold (TPSERVE_FOLD_NORMS=0), without the one-row GEMV (TPSERVE_GEMV=0),
without piecewise graphs (TPSERVE_PIECEWISE_GRAPHS=0), and the torch backend with graphs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (kernel, decode graphs, extra environment)
    "triton-graphs": ("triton", True, {}),
    "triton-eager": ("triton", False, {}),
    "triton-graphs-no-fold": ("triton", True, {"TPSERVE_FOLD_NORMS": "0"}),
    "triton-graphs-no-gemv": ("triton", True, {"TPSERVE_GEMV": "0"}),
    "triton-graphs-no-pieces": ("triton", True, {"TPSERVE_PIECEWISE_GRAPHS": "0"}),
    "torch-graphs": ("torch", True, {}),
    "torch-eager": ("torch", False, {}),
}
PROMPT_LENGTHS = (10, 45)
NEW_TOKENS = 30


def prompts() -> list[list[int]]:
    return [random.Random(f"graphs-{n}").choices(range(3, 301), k=n) for n in PROMPT_LENGTHS]


def first_mismatch(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)


def run_variant(work: Path, device: str, kernel: str, graphs: bool) -> None:
    """In a fresh process (TPSERVE_* switches are read at import): serve and report."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    from engine_utils import greedy_ids

    from tpserve.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )
    from tpserve.engine.engine import Engine
    from tpserve.executor.inprocess import InProcessExecutor

    ref = json.loads((work / "ref.json").read_text())
    cfg = EngineConfig(model=ModelConfig(path=str(work / "model"), model_id="t",
                                         max_model_len=256),
                       parallel=ParallelConfig(device=device),
                       cache=CacheConfig(block_size=16, num_blocks=128), kernel=kernel,
                       scheduler=SchedulerConfig(async_scheduling=False), cuda_graphs=graphs)
    engine = Engine(cfg, InProcessExecutor(cfg))
    try:
        together = greedy_ids(engine, prompts(), NEW_TOKENS)
        alone = [greedy_ids(engine, [p], NEW_TOKENS)[0] for p in prompts()]
    finally:
        engine.shutdown()
    for label, got in (("together", together), ("alone", alone)):
        for n, g, r in zip(PROMPT_LENGTHS, got, ref, strict=True):
            i = first_mismatch(g, r)
            print(f"  {label}, prompt of {n}: " + ("transformers' tokens" if i is None else
                  f"differs at token {i}: {g[i:i + 4]} against {r[i:i + 4]}"), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--work", help=argparse.SUPPRESS)  # set for the per-variant processes
    ap.add_argument("--run", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.run:
        kernel, graphs, _ = VARIANTS[args.run]
        run_variant(Path(args.work), args.device, kernel, graphs)
        return 0
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]
    from tiny_models import hf_greedy_ids, phi3_longrope_config, save_model

    work = Path(tempfile.mkdtemp(prefix="longrope-"))
    save_model(phi3_longrope_config(32), work / "model")
    ref = hf_greedy_ids(work / "model", prompts(), [NEW_TOKENS] * len(PROMPT_LENGTHS),
                        use_cache=False)
    (work / "ref.json").write_text(json.dumps(ref))
    for name in args.variants:
        _, _, env = VARIANTS[name]
        print(name, flush=True)
        subprocess.run([sys.executable, "-W", "ignore", __file__, "--run", name, "--work",
                        str(work), "--device", args.device], env={**os.environ, **env},
                       timeout=300, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
