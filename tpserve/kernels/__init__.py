"""Attention kernels behind one interface (base.py) and a lazy registry (registry.py)."""

from tpserve.kernels.base import AttentionBackend, AttentionMetadata, AttentionSpec
from tpserve.kernels.registry import available_names, select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionSpec", "available_names",
           "select_backend"]
