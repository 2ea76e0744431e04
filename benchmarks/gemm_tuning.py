"""The weight GEMMs of a decode step under three ways of picking the BLAS kernel: PyTorch's
default (cuBLAS), cuBLASLt preferred, and TunableOp (PyTorch times every cuBLASLt algorithm
for each shape once and keeps the fastest, in a file). Llama-3-8B layer shapes, bf16, one
GPU; each case is timed in a CUDA graph over enough weight copies to defeat the L2 cache, as
a decode step reads them. Prints us and TFLOP/s per shape and the sum for one step of 32
layers; appends the table to --out.

    python benchmarks/gemm_tuning.py --rows 1 32 256 --out gemm.md     # needs CUDA
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path

import torch
from report import emit, graph_us

SHAPES = (("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
          ("down", 4096, 14336), ("lm_head", 128256, 4096))
LAYERS = 32


def timed(x: torch.Tensor, weights: list[torch.Tensor], reps: int = 20) -> float:
    """us per matmul, replaying a graph that walks every weight copy once."""
    return graph_us(lambda: [torch.nn.functional.linear(x, w) for w in weights],
                    len(weights), reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--modes", nargs="+", default=["default", "cublaslt", "tunableop"])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device("cuda")
    results: dict[tuple[str, int], dict[str, float]] = {}
    for mode in args.modes:
        torch.backends.cuda.preferred_blas_library("cublaslt" if mode == "cublaslt"
                                                   else "cublas")
        if mode == "tunableop":
            import torch.cuda.tunable as tunable

            tunable.set_filename(str(Path(tempfile.mkdtemp()) / "tunableop.csv"))
            tunable.enable(True)
            tunable.tuning_enable(True)
        for name, n, k in SHAPES:
            copies = max(1, -(-256 * 2**20 // (n * k * 2)))  # > 256 MB: not from L2
            weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
                       for _ in range(copies)]
            for m in args.rows:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                results.setdefault((name, m), {})[mode] = timed(x, weights)
            del weights
        if mode == "tunableop":
            tunable.tuning_enable(False)
            tunable.enable(False)
    head = " | ".join(f"{m} us | {m} TFLOP/s" for m in args.modes)
    lines = [f"### Weight GEMMs by BLAS choice ({torch.cuda.get_device_name(0)}, torch "
             f"{torch.__version__}, {datetime.date.today().isoformat()})", "",
             f"| shape | rows | {head} |", "| --- " * (2 + 2 * len(args.modes)) + "|"]
    for (name, m), r in results.items():
        n, k = next((n, k) for s, n, k in SHAPES if s == name)
        cells = " | ".join(f"{r[md]:.1f} | {2 * m * n * k / r[md] / 1e6:.0f}" for md in args.modes)
        lines.append(f"| {name} | {m} | {cells} |")
    lines += ["", "One decode step's weight GEMMs (32 layers + LM head), ms:", "",
              "| rows | " + " | ".join(args.modes) + " |", "| --- " * (1 + len(args.modes)) + "|"]
    for m in args.rows:
        per = {md: sum(results[(s, m)][md] * (1 if s == "lm_head" else LAYERS)
                       for s, _, _ in SHAPES) / 1e3 for md in args.modes}
        lines.append(f"| {m} | " + " | ".join(f"{per[md]:.2f}" for md in args.modes) + " |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
