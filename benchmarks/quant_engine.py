"""tpserve's engine on one GPU (tp = 1, in-process, Triton attention, decode graphs) on the
Llama-3-8B shape with random weights, in bf16, GPTQ int4 (group size 128) and fp8, one
process each: batch-1 ms per token, batch-32 and 256 x 256/256 tokens/s, weight bytes per
GPU. Reuses benchmarks/gpu_engine.py's engine set-up and measurements.

    python3 benchmarks/quant_engine.py --out results/      # needs CUDA
    python3 benchmarks/quant_engine.py --out results/ --formats gptq-int4 bf16 \
        --tiles OUT/gemv_tiles.json                         # a sweep's tile table

int4 layers hold qweight in the checkpoint's row-major order for the Triton kernels
(TritonQuantKernel.int4_k_contiguous; tpserve/kernels/quant/base.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

FORMATS = {
    "bf16": None,
    "gptq-int4": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                  "sym": True},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
}


def model_dir(out: Path, quant: dict | None) -> Path:
    from gpu_engine import make_model_dir

    path = make_model_dir(out)
    if quant is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization_config"] = quant
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    ap.add_argument("--tiles", type=Path, help="JSON tile table of benchmarks/quant_sweep.py")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        from gpu_engine import run_one

        if args.tiles:
            from tpserve.kernels.quant.triton_tiles import set_tiles, tiles_from_json

            set_tiles(tiles_from_json(args.tiles.read_text()))
        print("RESULT " + json.dumps(run_one(args.one, "triton")), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    with tempfile.TemporaryDirectory() as d:
        for name in args.formats:
            path = model_dir(Path(d) / name, FORMATS[name])
            tiles = ["--tiles", str(args.tiles)] if args.tiles else []
            r = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--one",
                                str(path), *tiles], capture_output=True, text=True)
            (args.out / f"quant_engine_{name}.log").write_text(r.stdout + r.stderr)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                print(f"{name} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
                continue
            rows[name] = json.loads(line[0][7:])
            print(f"{name}: {json.dumps(rows[name])}", flush=True)
    import torch

    base = rows.get("bf16", {}).get("b1_ms")
    text = (f"### Quantized weights on one {torch.cuda.get_device_name(0)} "
            f"({datetime.date.today().isoformat()})\n\nLlama-3-8B shape, random weights, tp = 1 "
            "in-process engine, Triton attention and quantized matmuls, decode graphs. "
            "Weights: all parameters of the shard (embedding and LM head stay bf16)."
            + (f" Tiles: {args.tiles}." if args.tiles else "") + "\n\n"
            "| weights | GB per GPU | batch 1 ms/token | vs bf16 | batch 32 tok/s | "
            "256 x 256/256 tok/s | KV blocks | start-up s |\n" + "| --- " * 8 + "|\n")
    for name, r in rows.items():
        ratio = f"{r['b1_ms'] / base:.2f}x" if base else "-"
        text += (f"| {name} | {r['weights_gb']:.2f} | {r['b1_ms']:.2f} | {ratio} | "
                 f"{r['b32_tok_s']:.0f} | {r['cb256_tok_s']:.0f} | {r['kv_blocks']} | "
                 f"{r['startup_s']:.1f} |\n")
    print(text)
    (args.out / "quant_engine.md").write_text(text)
    return 0 if len(rows) == len(args.formats) else 1


if __name__ == "__main__":
    sys.exit(main())
