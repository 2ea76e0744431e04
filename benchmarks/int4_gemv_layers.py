"""The one-row int4 GEMV per decoder layer, launched as a decode step launches it, for one
or more source trees side by side on one CUDA GPU: Llama-3-8B's QKV with the input norm
folded in, o_proj, [gate; up] with its activation, down_proj with the residual add (GPTQ
int4, group 128, bfloat16 activations). Microseconds per call in a CUDA graph cycling
through >= 256 MB of weight copies (none served from L2, as in a decode step;
quant_sweep.py's timing), each output first checked against a float32
dequantize-then-matmul. Each tree runs in a process of its own (its own tpserve, its own
Triton kernels), in the order given, so an A/B of a kernel change is one command:

    git archive <commit> tpserve benchmarks tests | tar -x -C /tmp/old
    python benchmarks/int4_gemv_layers.py --tree old=/tmp/old --tree new=. --repeat 2 \\
        --out docs/benchmarks.md                                   # needs CUDA and Triton
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (name, K, N, what the decode step's launch also does)
LAYERS = (("qkv + norm", 4096, 6144, "rms"), ("o_proj", 4096, 4096, ""),
          ("gate_up gated", 4096, 28672, "gated"), ("down + residual", 14336, 4096, "res"))
MAX_REL_ERR = 2e-2  # bfloat16 products and the tree's own roundings; a wrong kernel is far off


def _reference(x, qw, s, z, mode, group, gamma, res):
    import torch

    from tpserve.kernels.quant.torch_ref import dequantize_int4

    xf = x.float()
    if mode == "rms":
        xf = xf * torch.rsqrt(xf.pow(2).mean() + 1e-5) * gamma.float()
    y = xf @ dequantize_int4(qw, s.float(), z.float(), group)
    if mode == "gated":
        n = y.shape[1] // 2
        y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    return y + res.float() if mode == "res" else y


def one_tree(root: str) -> dict:
    """Times every layer with the tpserve found at root; returns {layer: [us, rel err]}."""
    sys.path[:0] = [root, f"{root}/benchmarks", f"{root}/tests/kernels"]
    import torch
    from quant_sweep import COPY_BYTES, GROUP, graph_ms, tensors, weight_bytes

    from tpserve.kernels.quant.triton_kernel import quant_matmul

    dev = torch.device("cuda")
    out = {}
    for name, k, n, mode in LAYERS:
        copies = max(1, math.ceil(COPY_BYTES / weight_bytes("int4", k, n)))
        sets = tensors(k, n, dev, copies)
        x = torch.randn(1, k, device=dev).bfloat16()
        gamma = (1 + 0.1 * torch.randn(k, device=dev)).bfloat16()
        res = torch.randn(1, n, device=dev).bfloat16()
        extra = {"rms": dict(rms=(gamma, 1e-5)), "gated": dict(gated=1),
                 "res": dict(residual=res)}.get(mode, {})

        def call(t, x=x, extra=extra):
            return quant_matmul(x, t[0], t[1], t[2], None, GROUP, False, **extra)

        y = call(sets[0])
        if y is None:
            raise RuntimeError(f"{name}: this tree has no single launch for it")
        ref = _reference(x, *sets[0][:3], mode, GROUP, gamma, res)
        err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
        if not err < MAX_REL_ERR:
            raise RuntimeError(f"{name}: relative error {err:.3g} against the reference")
        out[name] = [graph_ms([functools.partial(call, t) for t in sets]) * 1e3, err]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", default=[], metavar="LABEL=PATH",
                    help="a source tree to time (default: this one, as 'this')")
    ap.add_argument("--repeat", type=int, default=1, help="time the tree list this many times")
    ap.add_argument("--out", type=Path, help="append the table to this markdown file")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("RESULT " + json.dumps(one_tree(args.one)), flush=True)
        return 0
    import torch

    if not torch.cuda.is_available():
        print("int4_gemv_layers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    trees = [t.split("=", 1) for t in args.tree] or [["this", str(ROOT)]]
    rows = []
    for _ in range(args.repeat):
        for label, path in trees:
            r = subprocess.run([sys.executable, __file__, "--one", str(Path(path).resolve())],
                               capture_output=True, text=True)
            line = [s for s in r.stdout.splitlines() if s.startswith("RESULT ")]
            if not line:
                print(f"{label} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
                return 1
            res = json.loads(line[0][7:])
            rows.append((label, res))
            print(f"{label}: " + ", ".join(f"{k} {v[0]:.2f} us" for k, v in res.items()),
                  flush=True)
    sys.path[:0] = [str(ROOT / "benchmarks")]
    from report import emit

    head = ["| tree | " + " | ".join(name for name, *_ in LAYERS) + " | four layers us "
            "| x 32 layers ms | worst relative error |", "| --- " * (len(LAYERS) + 4) + "|"]
    body = [f"| {label} | " + " | ".join(f"{res[name][0]:.2f}" for name, *_ in LAYERS)
            + f" | {sum(v[0] for v in res.values()):.1f} "
            f"| {sum(v[0] for v in res.values()) * 32 / 1e3:.3f} "
            f"| {max(v[1] for v in res.values()):.2e} |" for label, res in rows]
    emit([f"### One-row int4 GEMV per layer, as a decode step launches it "
          f"({torch.cuda.get_device_name(0)}, {datetime.date.today().isoformat()})", "",
          "Llama-3-8B shapes, GPTQ int4 group 128, bfloat16; us per call in a CUDA graph "
          "over weight copies that miss L2 (benchmarks/int4_gemv_layers.py).", "",
          *head, *body], args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
