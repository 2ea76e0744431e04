"""GEMM tuning of the decode buckets (kernels/gemm_tuning.py): off on the CPU and with
TPSERVE_TUNE_GEMMS=0, a pass-through below MIN_ROWS, and on a CUDA device the tuned GEMMs
give the default's results, write their file and are reused without tuning again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tpserve.kernels import gemm_tuning
from tpserve.kernels.gemm_tuning import GemmTuning


def test_off_on_the_cpu_and_when_asked():
    assert not gemm_tuning.wanted(torch.device("cpu"))
    t = GemmTuning(torch.device("cpu"), 0)
    assert t.start() is False and not t.on
    with t.tune(256):  # a no-op block, however many rows
        x = torch.ones(2, 2) @ torch.ones(2, 2)
    t.finish()
    assert x.sum() == 8 and t.seconds == 0.0


def test_switch(monkeypatch):
    monkeypatch.delenv(gemm_tuning.ENV, raising=False)
    assert not gemm_tuning.wanted(torch.device("cuda"))  # off by default
    monkeypatch.setenv(gemm_tuning.ENV, "0")
    assert not gemm_tuning.wanted(torch.device("cuda"))
    monkeypatch.setenv(gemm_tuning.ENV, "1")
    assert gemm_tuning.wanted(torch.device("cuda")) == hasattr(torch.cuda, "tunable")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_tuned_bucket_matches_default_and_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(gemm_tuning.ENV, "1")
    dev = torch.device("cuda")
    torch.manual_seed(0)
    w = torch.randn(1024, 512, device=dev, dtype=torch.bfloat16)
    x = torch.randn(gemm_tuning.MIN_ROWS, 512, device=dev, dtype=torch.bfloat16)
    ref = torch.nn.functional.linear(x, w)
    t = GemmTuning(dev, 0)
    try:
        assert t.start()
        with t.tune(gemm_tuning.MIN_ROWS - 1):
            small = torch.nn.functional.linear(x[:-1], w)  # below MIN_ROWS: not tuned
        with t.tune(gemm_tuning.MIN_ROWS):
            got = torch.nn.functional.linear(x, w)
        t.finish()
        assert t.path.exists() and t.path.parent == tmp_path / "tpserve" / "tunableop"
        results = torch.cuda.tunable.get_results()
        assert len(results) >= 1 and t.seconds > 0
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(small, ref[:-1], rtol=2e-2, atol=2e-2)
    finally:
        torch.cuda.tunable.enable(False)


def test_a_torch_without_tunableop_pieces_starts_untuned(monkeypatch):
    """A TunableOp call missing from this torch turns tuning off with a warning; the start
    goes on (it is an optional speed-up)."""
    from types import SimpleNamespace

    calls = []
    fake = SimpleNamespace(set_filename=lambda *a: (_ for _ in ()).throw(AttributeError("x")),
                           tuning_enable=lambda v: calls.append(("tuning", v)),
                           enable=lambda v: calls.append(("enable", v)))
    monkeypatch.setattr(torch.cuda, "tunable", fake, raising=False)
    monkeypatch.setattr(gemm_tuning, "wanted", lambda device: True)
    monkeypatch.setattr(gemm_tuning, "results_file", lambda device, rank: Path("/nonexistent/x"))
    t = GemmTuning(torch.device("cuda"), 0)
    assert t.start() is False and not t.on
    assert ("enable", False) in calls
    with t.tune(256):
        pass
    t.finish()  # nothing to write


def test_results_file_is_tunableops_format(tmp_path):
    from types import SimpleNamespace

    fake = SimpleNamespace(
        get_validators=lambda: [("PT_VERSION", "2.11.0"), ("CUBLASLT_VERSION", "130000")],
        get_results=lambda: [("GemmTunableOp_BFloat16_TN", "tn_4096_256_4096_ld_4096_4096_4096",
                              "Gemm_Cublaslt_7", 0.0123)])
    path = tmp_path / "r.csv"
    gemm_tuning.write_results(fake, path)
    assert path.read_text().splitlines() == [
        "Validator,PT_VERSION,2.11.0", "Validator,CUBLASLT_VERSION,130000",
        "GemmTunableOp_BFloat16_TN,tn_4096_256_4096_ld_4096_4096_4096,Gemm_Cublaslt_7,0.0123"]
    assert not (tmp_path / "r.tmp").exists()
