"""Grid dependency control inside the Triton kernels (kernels/pdl.py says when and why).
Imported by the kernel modules once Triton imports; a Triton without the CUDA intrinsics
(XPU builds) gets no-op stand-ins, never reached since such devices launch with PDL=False."""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the Triton build
    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement: let the next kernel launch now, then wait until the
    previous one's writes are visible. After this the kernel may read and write anything."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


__all__ = ["gdc_launch_dependents", "gdc_wait", "pdl_enter"]
