"""The one-row projections of 32 Llama-3-8B layers (tp = 1, bf16, one CUDA GPU) as a decode
step chains them, with and without the input norm folded into QKV (RMSNorm.fold_into,
LlamaDecoderLayer.forward_folded):

    unfolded: add + RMSNorm -> QKV GEMV -> o_proj GEMV -> add + RMSNorm -> gated GEMV -> down
    folded:   QKV GEMV normalising -> o_proj GEMV -> add + RMSNorm -> gated GEMV -> down adding

captured in one CUDA graph (programmatic dependent launch where the GPU has it), no
attention, each layer with its own weights (read from HBM, as in a step). Also each GEMV
alone per shape, plain and in its folded mode, over 32 weight copies. Prints us and appends
the tables to --out.

    python benchmarks/fold_chain.py --out fold.md        # needs CUDA
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from report import cuda_args, emit, graph_us  # noqa: E402

HIDDEN, QKV, INTER, LAYERS, EPS = 4096, 6144, 14336, 32, 1e-5


def main() -> int:
    from tpserve.kernels import fused_ops as fo
    from tpserve.kernels import gemv as G

    args = cuda_args(__doc__, "fold_chain")
    if args is None:
        return 2
    dev, dt = torch.device("cuda"), torch.bfloat16

    def weights(n, k):
        return [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(LAYERS)]

    w_qkv, w_o = weights(QKV, HIDDEN), weights(HIDDEN, HIDDEN)
    w_up, w_down = weights(2 * INTER, HIDDEN), weights(HIDDEN, INTER)
    norm_w = torch.rand(HIDDEN, device=dev, dtype=dt) + 0.5
    h0 = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    # The tiles warmup chooses for each shape (the default tile where F.linear won).
    t_qkv, t_o, t_down = ((G.choose(ws) or G.GemvChoice(None, 0, 0)).tile or G.DEFAULT_TILE
                          for ws in (w_qkv, w_o, w_down))
    t_up = (G.choose_gated(w_up, False) or G.GemvChoice(None, 0, 0)).tile or G.DEFAULT_TILE
    tiles = f"qkv {t_qkv.label()}, o_proj {t_o.label()}, gate_up {t_up.label()}, " \
        f"down {t_down.label()}"
    print(tiles, flush=True)

    def unfolded():
        x, res = h0, None
        for i in range(LAYERS):
            if res is None:
                h, res = fo.add_rms_norm_triton(x, None, norm_w, EPS)[0], x
            else:
                h, res = fo.add_rms_norm_triton(x, res, norm_w, EPS)
            qkv = G.gemv(h, w_qkv[i], t_qkv)
            o = G.gemv(qkv[:, :HIDDEN], w_o[i], t_o)
            h, res = fo.add_rms_norm_triton(o, res, norm_w, EPS)
            x = G.gemv(G.gated(h, w_up[i], t_up, False), w_down[i], t_down)
        return x

    def folded():
        h = h0
        for i in range(LAYERS):
            qkv = G.gemv(h, w_qkv[i], t_qkv, EPS)
            x, h = fo.add_rms_norm_triton(G.gemv(qkv[:, :HIDDEN], w_o[i], t_o), h, norm_w, EPS)
            h = G.gemv(G.gated(x, w_up[i], t_up, False), w_down[i], t_down, None, h)
        return h

    chain = {name: graph_us(fn, LAYERS, args.reps) * LAYERS
             for name, fn in (("unfolded", unfolded), ("folded", folded),
                              ("unfolded again", unfolded), ("folded again", folded))}
    x = torch.randn(1, HIDDEN, device=dev, dtype=dt)
    xi = torch.randn(1, INTER, device=dev, dtype=dt)
    single = []
    for name, ws, inp, plain, mode in (
            ("qkv", w_qkv, x, lambda a, w: G.gemv(a, w, t_qkv),
             lambda a, w: G.gemv(a, w, t_qkv, EPS)),
            ("o_proj", w_o, x, lambda a, w: G.gemv(a, w, t_o),
             lambda a, w: G.gemv(a, w, t_o, None, x)),
            ("down", w_down, xi, lambda a, w: G.gemv(a, w, t_down),
             lambda a, w: G.gemv(a, w, t_down, None, x))):
        us = [graph_us(lambda f=f, ws=ws, inp=inp: [f(inp, w) for w in ws], LAYERS, args.reps)
              for f in (plain, mode)]
        single.append(f"| {name} | {us[0]:.1f} | {us[1]:.1f} |")
        print(single[-1], flush=True)
    name = torch.cuda.get_device_name()
    lines = [f"Folded norms, one-row chain of {LAYERS} layers ({name}, torch {torch.__version__}, "
             f"tiles {tiles}), us per step's chain in a CUDA graph:", "",
             "| chain | us |", "| --- | --- |",
             *[f"| {k} | {v:.1f} |" for k, v in chain.items()], "",
             "Each GEMV alone, us per call (32 weight copies, cold in L2):", "",
             "| layer | plain | folded mode (rms or residual) |", "| --- | --- | --- |", *single]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
