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
    assert "acme/not-in-cache" in r.stderr and "looked in" in r.stderr


def test_unshardable_tp_exits_2_before_starting_ray(llama_dir, tmp_path):
    r = _run("launch", "--model", str(llama_dir), "--tp", "3", "--no-dashboard", home=tmp_path)
    assert r.returncode == 2
    assert "tp=3" in r.stderr and "not divisible" in r.stderr
    assert "Started a local Ray instance" not in r.stdout + r.stderr


def _server_args(*argv: str):
    return apply_preset(build_parser(), ["launch", *argv])


def test_server_flags_and_env_keys(monkeypatch, caplog):
    from tpserve.cli import server_config

    monkeypatch.setenv("TPSERVE_API_KEY", "env-a, env-b")
    cfg = server_config(_server_args("--api-key", "flag-k", "--max-body-bytes", "1000",
                                     "--request-timeout", "2.5", "--metrics-public"))
    assert cfg.api_keys == ("flag-k", "env-a", "env-b")
    assert (cfg.max_body_bytes, cfg.request_timeout_s, cfg.metrics_public) == (1000, 2.5, True)
    assert "without an API key" not in caplog.text


def test_open_address_without_key_warns(monkeypatch, caplog):
    from tpserve.cli import server_config

    monkeypatch.delenv("TPSERVE_API_KEY", raising=False)
    server_config(_server_args("--host", "127.0.0.1"))
    assert "without an API key" not in caplog.text
    server_config(_server_args("--host", "0.0.0.0"))
    assert "serving on 0.0.0.0 without an API key" in caplog.text


@pytest.mark.parametrize("argv,message", [
    (["--ssl-certfile", "c.pem"], "--ssl-keyfile"),
    (["--max-body-bytes", "0"], "--max-body-bytes"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--api-key", ""], "--api-key"),
])
def test_bad_server_flags_are_refused(monkeypatch, argv, message):
    from tpserve.cli import server_config

    monkeypatch.delenv("TPSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message):
        server_config(_server_args(*argv))
