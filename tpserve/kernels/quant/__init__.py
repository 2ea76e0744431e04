"""Quantized matmul kernels (int4 weight x 16/32-bit activation, fp8 weight-only) behind one
interface, chosen per device like the attention backends; see registry.py."""
