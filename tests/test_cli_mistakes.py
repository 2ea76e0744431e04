"""A new user's mistakes on `tpserve launch`: each is one line saying what to do, exit
status 2, within seconds, and nothing started (Ray or the HTTP server)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpserve import cli, preflight

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_ray(monkeypatch):
    """A launch that got past its checks fails the test instead of starting Ray."""
    import ray

    def started(*_a, **_kw):
        raise AssertionError("Ray was started: the mistake was not caught before it")

    monkeypatch.setattr(ray, "init", started)


def _main(capsys, *argv: str) -> str:
    assert cli.main(["launch", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("tpserve: error:") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("argv,message", [
    # each used to fail late or not at all: a ZeroDivisionError traceback (--tp 0), a Ray
    # placement error (--tp -1), an actor's ZeroDivisionError (--block-size 0), "no memory
    # is left for the KV cache" (--max-batch-size 0, --kv-cache-memory-gb 0), bind() after
    # Ray started (--port), or silently the default (--cpus-per-shard 0) or a nonsense
    # fraction (--gpu-memory-utilization 1.5)
    (["--tp", "0"], "--tp must be >= 1 (got 0)"),
    (["--tp", "-1"], "--tp must be >= 1 (got -1)"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
    (["--max-batch-tokens", "0"], "--max-batch-tokens must be >= 1"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1"),
    (["--cpus-per-shard", "0"], "--cpus-per-shard must be >= 1"),
    (["--port", "70000"], "--port must be >= 0 and <= 65535 (got 70000)"),
    (["--port", "-5"], "--port must be >= 0 and <= 65535"),
    (["--kv-cache-memory-gb", "0"], "--kv-cache-memory-gb must be > 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be > 0 and <= 1"),
    (["--gpu-memory-utilization", "nan"], "--gpu-memory-utilization must be > 0 and <= 1"),
    (["--max-total-tokens", "1"], "--max-total-tokens must be >= 2"),
    (["--max-concurrent-requests", "0"], "--max-concurrent-requests must be >= 1"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
])
def test_out_of_range_flags_are_refused_before_anything_starts(capsys, no_ray, argv, message):
    assert message in _main(capsys, *argv)


def test_a_preset_value_is_range_checked_too(capsys, no_ray, tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("tp: 0\n")  # argparse's types never see a preset's values
    assert "--tp must be >= 1 (got 0)" in _main(capsys, "--config", str(preset))
    preset.write_text("block-size: [16]\n")
    assert "--block-size takes a number, not [16]" in _main(capsys, "--config", str(preset))


@pytest.mark.parametrize("text,message", [
    (None, "No such file or directory"),
    ("tp: [2\n", "is not valid YAML"),
    ("- tp: 2\n", "must map flag names to values"),
])
def test_a_preset_that_cannot_be_read_is_a_usage_error(capsys, tmp_path, text, message):
    preset = tmp_path / "p.yaml"
    if text is not None:
        preset.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        cli.apply_preset(cli.build_parser(), ["launch", "--config", str(preset)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and str(preset) in err


@pytest.mark.parametrize("name", ["model.safetensors", "config.json"])
def test_a_file_given_as_the_model_names_its_directory(capsys, no_ray, llama_dir, name):
    """It used to say the file `does not exist` (./x) or try the hub for it (x)."""
    err = _main(capsys, "--model", str(llama_dir / name))
    assert f"--model {llama_dir / name} is a file" in err and f"here {llama_dir}" in err


def test_a_weight_file_cut_off_is_refused_by_name(capsys, no_ray, llama_dir, tmp_path):
    """A copy or transfer that stopped: it passed the checks and failed in every shard with
    safetensors' "incomplete metadata, file not fully covered", naming no file."""
    import shutil

    cut = shutil.copytree(llama_dir, tmp_path / "cut")
    weights = cut / "model.safetensors"
    size = weights.stat().st_size
    with weights.open("r+b") as f:
        f.truncate(size - 1000)
    err = _main(capsys, "--model", str(cut))
    assert f"{weights} is cut off: {size - 1000} bytes where its header describes {size}" \
        in err, err
    with weights.open("r+b") as f:  # cut inside the header
        f.truncate(20)
    assert f"{weights} is cut off or not a safetensors file" in _main(capsys, "--model", str(cut))


def test_max_input_tokens_must_leave_room_for_a_generated_token(capsys, no_ray, llama_dir):
    # TGI's rule; the server used to start and then answer every long prompt oddly.
    err = _main(capsys, "--model", str(llama_dir), "--max-input-tokens", "2000",
                "--max-total-tokens", "1000")
    assert "--max-input-tokens (2000) must be below" in err and "1000" in err
    err = _main(capsys, "--model", str(llama_dir), "--max-total-tokens", "64",
                "--max-input-tokens", "64")
    assert "--max-input-tokens (64) must be below" in err


def test_more_cpu_shards_than_cores_run_with_a_warning(monkeypatch, caplog, llama_dir):
    """CPU shards share cores (tests and small machines serve --tp 4 on two): the launch goes
    on and says it will be slower, unless --cpus-per-shard chose, or a cluster was joined."""
    monkeypatch.setattr(preflight.os, "cpu_count", lambda: 2)
    args = ["launch", "--model", str(llama_dir), "--device", "cpu", "--tp", "4"]
    with caplog.at_level("WARNING", logger="tpserve"):
        cfg = cli.engine_config(cli.apply_preset(cli.build_parser(), args))
    assert cfg.parallel.tp_size == 4
    assert "4 CPU shards (--tp x --replicas) share this machine's 2 core(s)" in caplog.text
    for extra in (["--cpus-per-shard", "1"], ["--address", "auto"]):
        caplog.clear()
        with caplog.at_level("WARNING", logger="tpserve"):
            cfg = cli.engine_config(cli.apply_preset(cli.build_parser(), args + extra))
        assert cfg.parallel.tp_size == 4 and "share this machine" not in caplog.text


def test_more_gpu_shards_than_gpus_is_refused(monkeypatch, llama_dir):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    args = cli.apply_preset(cli.build_parser(), ["launch", "--model", str(llama_dir),
                                                 "--device", "cuda", "--tp", "2"])
    with pytest.raises(ValueError, match=r"need 2 CUDA devices, one each, but PyTorch sees 1 "
                                         r"here \(CUDA_VISIBLE_DEVICES=3\)"):
        cli.engine_config(args)


def test_strict_spread_without_a_cluster_is_refused_before_ray_starts(capsys, no_ray,
                                                                     llama_dir):
    """The one-node cluster tpserve starts could never place it: this used to be found by
    the driver actor after Ray had started, with its traceback in the log."""
    err = _main(capsys, "--model", str(llama_dir), "--tp", "2", "--placement", "strict-spread")
    assert "--placement strict-spread puts each of the 2 shards on its own node" in err
    assert "--address" in err


def test_a_port_in_use_is_refused_before_ray_starts(capsys, no_ray, llama_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        err = _main(capsys, "--model", str(llama_dir), "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in err
    assert "pick another --port" in err
    # An address this machine does not have (TEST-NET-3) says to check --host instead.
    err = _main(capsys, "--model", str(llama_dir), "--host", "203.0.113.9", "--port", "8080")
    assert "cannot listen on 203.0.113.9:8080" in err and "check --host" in err


def test_an_address_without_a_ray_cluster_says_how_to_start_one(capsys, no_ray, llama_dir,
                                                                monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    err = _main(capsys, "--model", str(llama_dir), "--address", f"127.0.0.1:{port}",
                "--port", "0")  # not 8080, which another server on this machine may hold
    assert f"no Ray cluster answers at 127.0.0.1:{port}" in err
    assert f"`ray start --head --port {port}`" in err and time.monotonic() - t0 < 20
    # `auto` finds no cluster: Ray's ConnectionError used to end in a traceback.
    import ray

    def none_running(**_kw):
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray, "init", none_running)
    err = _main(capsys, "--model", str(llama_dir), "--address", "auto", "--port", "0")
    assert "could not join the Ray cluster at --address auto" in err
    assert "`ray start --head`" in err


def test_tls_files_that_cannot_be_loaded_are_refused(tmp_path, monkeypatch):
    # The server used to report "serving" while its HTTPS listener had died on the file.
    monkeypatch.delenv("TPSERVE_API_KEY", raising=False)

    def server(*argv):
        return cli.server_config(cli.apply_preset(cli.build_parser(), ["launch", *argv]))

    with pytest.raises(ValueError, match="--ssl-certfile /no/c.pem: no such file"):
        server("--ssl-certfile", "/no/c.pem", "--ssl-keyfile", "/no/k.pem")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("not a certificate\n")
    key.write_text("not a key\n")
    with pytest.raises(ValueError, match="cannot be loaded .*unencrypted PEM private key"):
        server("--ssl-certfile", str(cert), "--ssl-keyfile", str(key))


def _cli(*argv: str, home: Path) -> subprocess.CompletedProcess:
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(home),
           "HF_HUB_CACHE": str(home / "hub")}
    return subprocess.run([sys.executable, "-m", "tpserve.cli", *argv], capture_output=True,
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL, cwd=ROOT)


def test_an_error_is_one_line_on_stderr(tmp_path):
    """The message used to come twice, as a log record and as the `tpserve: error:` line."""
    r = _cli("launch", "--model", "acme/not-in-cache", home=tmp_path)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if "not in the hub cache" in line]
    assert len(lines) == 1 and lines[0].startswith("tpserve: error: "), r.stderr


def test_a_launch_logs_no_transformers_deprecation_notes(tmp_path):
    """Reading the config for the shards touched deprecated properties, and transformers
    printed `torch_dtype is deprecated` and `use_return_dict is deprecated` on each launch."""
    code = ("from tpserve.cli import apply_preset, build_parser, engine_config\n"
            "engine_config(apply_preset(build_parser(), ['launch', '--device', 'cpu']))\n"
            "print('configured')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env={"PATH": "/usr/bin:/bin",
                                                   "HOME": str(tmp_path)})
    assert r.returncode == 0 and "configured" in r.stdout, r.stderr
    assert "deprecated" not in r.stderr, r.stderr


@pytest.mark.parametrize("argv,message", [
    (["launch", "--tp", "two"], "tpserve launch: error: argument --tp: invalid int value: 'two'"),
    (["launch", "--dtype", "float64"], "tpserve launch: error: argument --dtype: invalid choice"),
    (["launch", "--modle", "x"], "tpserve launch: error: unrecognized arguments: --modle x"),
    (["kernels", "--device", "tpu"], "tpserve kernels: error: argument --device: invalid"),
    ([], "tpserve: error: the following arguments are required: {launch,kernels}"),
])
def test_a_usage_mistake_is_one_line_naming_the_help_to_read(argv, message):
    """argparse printed launch's whole usage (some fifty lines) above the line that said what
    was wrong; an unknown flag was said by `tpserve`, whose --help lists no launch flag."""
    r = subprocess.run([sys.executable, "-m", "tpserve.cli", *argv], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(message), lines[0]
    command = " ".join(["tpserve", *argv[:1]])
    assert lines[0].endswith(f"(`{command} --help` lists the flags)"), lines[0]


@pytest.mark.parametrize("flag,known", [("--kernel", "ipex, triton, torch"),
                                        ("--quant-kernel", "triton, torch")])
def test_an_unknown_kernel_is_refused_before_ray_starts(capsys, no_ray, llama_dir, flag, known):
    """It failed in every shard after Ray started: tracebacks, then exit 1."""
    err = _main(capsys, "--model", str(llama_dir), flag, "bogus")
    assert f"{flag} 'bogus' is not a kernel here: choose auto or one of" in err, err
    assert known in err and "`tpserve kernels`" in err
