"""The driver actor's GIL hand-over interval (cluster/driver.py: gil_switch_s)."""

from __future__ import annotations

import pytest

from tpserve.cluster.driver import SWITCH_ENV, SWITCH_MS, gil_switch_s


def test_the_default_is_longer_than_cpythons(monkeypatch):
    monkeypatch.delenv(SWITCH_ENV, raising=False)
    assert gil_switch_s() == SWITCH_MS / 1e3
    assert gil_switch_s() > 0.005  # CPython's own default, which the driver replaces


def test_the_environment_sets_it_in_milliseconds(monkeypatch):
    monkeypatch.setenv(SWITCH_ENV, "2.5")
    assert gil_switch_s() == pytest.approx(0.0025)


@pytest.mark.parametrize("raw", ["fast", "0", "-3", "nan"])
def test_a_bad_value_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(SWITCH_ENV, raw)
    with pytest.raises(ValueError, match=SWITCH_ENV):
        gil_switch_s()
