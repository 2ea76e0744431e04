"""Running Triton kernels on the CPU for the kernel tests: TRITON_INTERPRET is read when the
kernels are defined, so each run is a fresh Python process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_interpreted(body: str, timeout: int = 900) -> str:
    """Run `body` (Python, with tests/kernels importable) under Triton's interpreter; skip
    the calling test where triton is not installed, fail it if the body fails. Returns the
    body's standard output."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.skip("triton is not installed (pip install triton to run its kernels on CPU)")
    script = f"import sys\nsys.path.insert(0, {str(HERE)!r})\n" + textwrap.dedent(body)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-c", script], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def assert_no_failures_interpreted(module: str, call: str) -> None:
    """Under the interpreter, `call` (an expression in `module` of tests/kernels returning
    the list of failed cases) must return []."""
    out = run_interpreted(f"""
        import torch
        from {module} import *
        bad = {call}
        assert bad == [], bad
        print("no failures")
    """)
    assert "no failures" in out
