"""The quantized-matmul interface every kernel (torch reference, Triton, plugins) implements.

Stored layouts (what the linear layers hand a kernel, whatever the checkpoint format was):
- int4: qweight int32 [K // 8, N], input row 8 * r + i in bits 4i..4i+3 of row r (GPTQ's
  order; AWQ is repacked at load). scales and zeros [G, N] in float16 (float32 for float32
  models), so w[k, n] = (q[k, n] - zeros[g, n]) * scales[g, n] with g = g_idx[k] when act-order
  gives one, else k // group_size. Where qweight sits in memory is the kernel's choice
  (int4_k_contiguous): row-major as in the checkpoint, or K-contiguous (strides (1, K // 8):
  [N, K // 8] row-major, each output column's packed inputs in one run), which the layer
  allocates before its rank's slice is copied in.
- fp8: weight float8_e4m3fn [N, K], scale [N] float32: w[n, k] = weight[n, k] * scale[n];
  or, with block = (bn, bk), one scale per block of bn rows and bk columns, scale
  [ceil(N / bn), ceil(K / bk)] float32: w[n, k] = weight[n, k] * scale[n // bn, k // bk] (the
  last blocks may be cut by N and K).
Both return x @ w for x [M, K] in x's dtype. A kernel reads the weights in these layouts (or,
for int4, in the private form its int4_pack returned for the layer) and never keeps a
dequantized copy between calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

METHODS = ("int4", "fp8")


class QuantKernel(ABC):
    name: str = "abstract"
    # True: layers hold qweight K-contiguous for this kernel (see the module docstring); a
    # kernel reads either order correctly, this one fast.
    int4_k_contiguous: bool = False

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, method: str) -> str | None:
        """None when this kernel can run `method` ("int4" | "fp8") for activations of dtype on
        device; else the reason it cannot."""

    @abstractmethod
    def int4_matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    zeros: torch.Tensor, group_size: int,
                    g_idx: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ dequantized int4 weight [K, N] -> [M, N]."""

    @abstractmethod
    def fp8_matmul(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
        """x [M, K] @ (weight [N, K] * scale[:, None]).T -> [M, N]; with block = (bn, bk),
        scale holds one value per block of the weight (the module docstring)."""

    def int4_pack(self, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  group_size: int, g_idx: torch.Tensor | None, dtype: torch.dtype,
                  paired: bool) -> torch.Tensor | None:
        """A private form of a layer's qweight that this kernel's int4 calls read faster, made
        once per layer in warmup (the layer then holds it instead of the stored layout), or
        None to keep the stored layout. dtype: the activations'. paired: qweight's columns
        are two halves [a; b] (a gated MLP's [gate; up]) that a gated launch pairs up.
        Optional: the default keeps the stored layout."""
        return None

    def int4_normed_matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                           zeros: torch.Tensor, group_size: int, gamma: torch.Tensor,
                           eps: float, g_idx: torch.Tensor | None = None) -> torch.Tensor | None:
        """int4_matmul of an RMSNorm's output, x / sqrt(mean(x^2) + eps) * gamma, from the
        raw x in one launch (a decoder layer's input norm folded into its QKV projection),
        or None where this kernel has no such launch for x. Optional: the default has none."""
        return None

    def int4_add_matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor, group_size: int, residual: torch.Tensor,
                        g_idx: torch.Tensor | None = None) -> torch.Tensor | None:
        """residual + int4_matmul(x) in one launch (the product rounded to x's dtype before
        the add), or None where this kernel has no such launch. Optional: none by default."""
        return None

    def int4_gated_matmul(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor, group_size: int,
                          gelu_tanh: bool) -> torch.Tensor | None:
        """A gated MLP's projection and activation at once: qweight's N columns are [gate; up],
        and the result is act(x W_gate) * (x W_up), [M, N / 2] (act: silu, or the tanh GELU
        with gelu_tanh; g and u each rounded to x's dtype before it), or None where this
        kernel has no such launch for x (the layer then runs int4_matmul and the activation).
        Optional: the default has none."""
        return None


def empty_qweight(k_words: int, n: int, k_contiguous: bool, device=None) -> torch.Tensor:
    """An int32 qweight [k_words, N], K-contiguous (strides (1, k_words)) when asked."""
    if k_contiguous:
        return torch.empty(n, k_words, dtype=torch.int32, device=device).t()
    return torch.empty(k_words, n, dtype=torch.int32, device=device)
