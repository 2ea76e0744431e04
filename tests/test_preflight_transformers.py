"""`tpserve launch` refuses a transformers older than the one tpserve is checked against,
naming both versions, and pyproject.toml declares the same floor."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tpserve import preflight
from tpserve.cli import main

FLOOR = ".".join(map(str, preflight.TRANSFORMERS_MIN))


@pytest.mark.parametrize("old", ["4.45.2", "4.56.2", "3.5.1", "0.1"])
def test_an_older_transformers_is_refused_naming_both_versions(old):
    with pytest.raises(ValueError) as err:
        preflight.check_transformers(old)
    assert f"transformers >= {FLOOR}" in str(err.value)
    assert f"this environment has {old}:" in str(err.value)


@pytest.mark.parametrize("ok", [FLOOR + ".0", "4.57.6", "5.0.0", "5.25.0", "10.1.0.dev0"])
def test_the_floor_and_newer_pass(ok):
    preflight.check_transformers(ok)


def test_launch_stops_at_once_with_the_message(monkeypatch, capsys):
    monkeypatch.setattr(preflight.metadata, "version", lambda dist: "4.45.2")
    assert main(["launch", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert f"tpserve: error: tpserve needs transformers >= {FLOOR}; this environment has " \
        "4.45.2" in err


def test_pyproject_declares_the_same_floor():
    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'"transformers>=([\d.]+)"', text).group(1) == FLOOR
