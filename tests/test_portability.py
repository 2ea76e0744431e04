"""Device code stays generic: calls that exist for one vendor only live in the kernel
backends and in the device/collective set-up (tpserve/cluster/device.py)."""

from __future__ import annotations

import re
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "tpserve"
ALLOWED = {PKG / "cluster" / "device.py"}
VENDOR = re.compile(r"torch\.(cuda|xpu)\b|\.cuda\(|intel_extension_for_pytorch|oneccl_bindings"
                    r"|\bnccl\b|\bxccl\b")


def test_vendor_calls_only_in_kernels_and_device_setup():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path in ALLOWED or (PKG / "kernels") in path.parents:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if VENDOR.search(code) and not code.strip().startswith(('"', "'")):
                offenders.append(f"{path.relative_to(PKG.parent)}:{n}: {line.strip()}")
    assert not offenders, "vendor-specific calls outside kernels/ and device.py:\n" + "\n".join(
        offenders)
