"""Weight-only quantized matmuls on a GPU at the Llama-3-8B layer shapes: bf16 (torch) next
to int4 (held K-contiguous, as layers hold it for Triton) and fp8 with per-channel and with
128 x 128 block scales (Triton, and the torch reference), per layer and summed over one
decoder layer x 32, for decode-sized batches.

    python3 benchmarks/quant_bench.py --out results/   # needs CUDA; writes markdown + JSON
    python3 benchmarks/quant_bench.py --out results/ --tiles OUT/quant_tiles.json  # a sweep's

Times are medians of CUDA-event timed replays (triton.testing.do_bench, L2 flushed between
replays), so a weight is read from HBM each time, as in a decode step. "GB/s" is weight
bytes (plus scales/zeros) over time: compare with the ~4.3 TB/s the H200 copies at.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, K = input features, N = output features) of one Llama-3-8B decoder layer, tp = 1.
LAYERS = (("qkv_proj", 4096, 6144), ("o_proj", 4096, 4096), ("gate_up_proj", 4096, 28672),
          ("down_proj", 14336, 4096))
NUM_LAYERS = 32
BATCHES = (1, 4, 16, 64, 256)
GROUP = 128
FP8_BLOCK = (128, 128)  # weight_block_size of the official FP8 releases (Qwen3-8B-FP8 ...)


def tensors(k: int, n: int, dev: torch.device, dt: torch.dtype):
    g = torch.Generator(device=dev).manual_seed(0)
    qweight = torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, device=dev,
                            generator=g)
    scales = torch.rand(k // GROUP, n, device=dev, generator=g).half() * 0.01
    zeros = torch.full((k // GROUP, n), 8.0, device=dev, dtype=torch.float16)
    w_bf16 = torch.randn(n, k, device=dev, generator=g).to(dt) * 0.02
    w_fp8 = (torch.randn(n, k, device=dev, generator=g) * 100).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    fp8_scale = torch.rand(n, device=dev, generator=g) * 1e-3
    blocks = (-(-n // FP8_BLOCK[0]), -(-k // FP8_BLOCK[1]))
    fp8_blocks = torch.rand(*blocks, device=dev, generator=g) * 1e-3 + 1e-4
    return qweight, scales, zeros, w_bf16, w_fp8, (fp8_scale, fp8_blocks)


def check(tri, ref, x, qw, s, z, w8, s8) -> str:
    """Triton against the torch reference at this shape; '' when they agree."""
    for label, a, b in (
            ("int4", tri.int4_matmul(x, qw, s, z, GROUP), ref.int4_matmul(x, qw, s, z, GROUP)),
            ("fp8", tri.fp8_matmul(x, w8, s8[0]), ref.fp8_matmul(x, w8, s8[0])),
            ("fp8-block", tri.fp8_matmul(x, w8, s8[1], FP8_BLOCK),
             ref.fp8_matmul(x, w8, s8[1], FP8_BLOCK))):
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        if not err < 2e-2:
            return f"{label}: relative error {err:.3g}"
    return ""


def _wall_ms(fn) -> float:
    import time

    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def time_all(tri, ref, x, qw, s, z, wb, w8, s8) -> dict[str, float]:
    if x.device.type == "cuda":
        from triton.testing import do_bench
    else:  # --dry-run: one call each, to check the script itself
        def do_bench(fn, **_):
            return _wall_ms(fn)
    fns = {
        "bf16": lambda: torch.nn.functional.linear(x, wb),
        "int4": lambda: tri.int4_matmul(x, qw, s, z, GROUP),
        "fp8": lambda: tri.fp8_matmul(x, w8, s8[0]),
        "fp8-block": lambda: tri.fp8_matmul(x, w8, s8[1], FP8_BLOCK),
        "int4-torch-ref": lambda: ref.int4_matmul(x, qw, s, z, GROUP),
    }
    return {key: do_bench(fn, warmup=25, rep=100, return_mode="median")
            for key, fn in fns.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes on the CPU (run with TRITON_INTERPRET=1): checks the script")
    ap.add_argument("--tiles", type=Path,
                    help="JSON tile table written by benchmarks/quant_sweep.py to use instead of "
                    "tpserve/kernels/quant/triton_tiles.py's")
    args = ap.parse_args(argv)
    if args.tiles:
        from tpserve.kernels.quant.triton_tiles import set_tiles, tiles_from_json

        set_tiles(tiles_from_json(args.tiles.read_text()))
    global LAYERS, BATCHES
    if args.dry_run:
        LAYERS = tuple((name, k // 16, n // 16) for name, k, n in LAYERS)
        BATCHES = (1, 17)
    from tpserve.kernels.quant.torch_ref import TorchQuantKernel
    from tpserve.kernels.quant.triton_kernel import TritonQuantKernel

    dev = torch.device("cpu" if args.dry_run else "cuda")
    dt = torch.float16 if args.dry_run else torch.bfloat16  # numpy has no bfloat16
    tri, ref = TritonQuantKernel(), TorchQuantKernel()
    rows, results = [], []
    totals: dict[tuple[int, str], float] = {}
    for name, k, n in LAYERS:
        qw, s, z, wb, w8, s8 = tensors(k, n, dev, dt)
        if tri.int4_k_contiguous:  # the memory order layers give the kernel (base.py)
            qw = qw.t().contiguous().t()
        by = {"bf16": wb.numel() * 2, "int4": qw.numel() * 4 + s.numel() * 2 + z.numel() * 2,
              "fp8": w8.numel() + s8[0].numel() * 4}
        for m in BATCHES:
            x = torch.randn(m, k, device=dev, dtype=dt)
            err = check(tri, ref, x, qw, s, z, w8, s8)
            if err:
                print(f"MISMATCH {name} M={m}: {err}")
                return 1
            ms = time_all(tri, ref, x, qw, s, z, wb, w8, s8)
            for key, t in ms.items():
                totals[(m, key)] = totals.get((m, key), 0.0) + t * NUM_LAYERS
            results.append({"layer": name, "K": k, "N": n, "M": m, **ms})
            rows.append(f"| {name} | {k} x {n} | {m} | {ms['bf16']:.4f} | {ms['int4']:.4f} | "
                        f"{ms['fp8']:.4f} | {ms['fp8-block']:.4f} | "
                        f"{ms['int4'] / ms['bf16']:.2f} | "
                        f"{ms['fp8'] / ms['bf16']:.2f} | "
                        f"{by['bf16'] / ms['bf16'] / 1e6:.0f} / {by['int4'] / ms['int4'] / 1e6:.0f}"
                        f" / {by['fp8'] / ms['fp8'] / 1e6:.0f} | {ms['int4-torch-ref']:.3f} |")
    head = ["| layer | K x N | M | bf16 ms | int4 ms | fp8 ms | fp8 block ms | int4 / bf16 | "
            "fp8 / bf16 | GB/s bf16 / int4 / fp8 | int4 torch-ref ms |", "| --- " * 11 + "|"]
    sums = ["", f"Sum over the {NUM_LAYERS} decoder layers' linears (ms per step, weights only):",
            "", "| M | bf16 | int4 | fp8 | fp8 block | int4 / bf16 | fp8 / bf16 | "
            "fp8 block / fp8 |", "| --- " * 8 + "|"]
    for m in BATCHES:
        b, i, f = totals[(m, "bf16")], totals[(m, "int4")], totals[(m, "fp8")]
        fb = totals[(m, "fp8-block")]
        sums.append(f"| {m} | {b:.3f} | {i:.3f} | {f:.3f} | {fb:.3f} | {i / b:.2f} | "
                    f"{f / b:.2f} | {fb / f:.2f} |")
    gpu = "CPU dry run" if args.dry_run else torch.cuda.get_device_name(dev)
    machine = f"{gpu}, torch {torch.__version__}, " \
              f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC"
    text = "\n".join([f"Quantized GEMV/GEMM at Llama-3-8B shapes ({machine}), group size "
                      f"{GROUP}", "", *head, *rows, *sums]) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant_bench.md").write_text(text)
    (args.out / "quant_bench.json").write_text(json.dumps(results, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
