"""The command line: every flag documented, presets, and errors that say what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tpserve.cli import apply_preset, build_parser

ROOT = Path(__file__).resolve().parents[1]


def _launch_flags() -> list[str]:
    sub = build_parser()._subparsers._group_actions[0].choices["launch"]  # noqa: SLF001
    return [o for a in sub._actions for o in a.option_strings  # noqa: SLF001
            if o.startswith("--") and o != "--help"]


def test_every_launch_flag_is_documented_in_readme():
    readme = (ROOT / "README.md").read_text()
    missing = [f for f in _launch_flags() if f"`{f}`" not in readme]
    assert not missing, f"flags missing from README's flag table: {missing}"


def test_preset_fills_defaults_and_flags_win(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("model: acme/x\ntp: 4\ndtype: bfloat16\n")
    args = apply_preset(build_parser(), ["launch", "--config", str(preset), "--tp", "2"])
    assert (args.model, args.tp, args.dtype) == ("acme/x", 2, "bfloat16")


def test_preset_with_unknown_key_is_refused(tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text("modle: acme/x\n")
    with pytest.raises(SystemExit):
        apply_preset(build_parser(), ["launch", "--config", str(preset)])
    assert "unknown keys modle" in capsys.readouterr().err


@pytest.mark.parametrize("preset", sorted((ROOT / "configs").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_shipped_presets_parse(preset):
    args = apply_preset(build_parser(), ["launch", "--config", str(preset)])
    assert args.model and args.tp >= 1


def _run(*argv: str, home: Path) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(home),
           "HF_HUB_CACHE": str(home / "hub")}
    return subprocess.run([sys.executable, "-m", "tpserve.cli", *argv], capture_output=True,
                          text=True, timeout=120, env=env)


def test_unknown_model_exits_2_naming_where_it_looked(tmp_path):
    r = _run("launch", "--model", "acme/not-in-cache", "--no-dashboard", home=tmp_path)
    assert r.returncode == 2
    assert "acme/not-in-cache" in r.stderr and str(tmp_path / "hub") in r.stderr
    assert "HF_HUB_OFFLINE" in r.stderr  # offline: says why it did not download
    r = _run("launch", "--model", "./no/such/dir", "--no-dashboard", home=tmp_path)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_unshardable_tp_exits_2_before_starting_ray(llama_dir, tmp_path):
    r = _run("launch", "--model", str(llama_dir), "--tp", "3", "--no-dashboard", home=tmp_path)
    assert r.returncode == 2
    assert "tp=3" in r.stderr and "not divisible" in r.stderr
    assert "Started a local Ray instance" not in r.stdout + r.stderr
