"""The command line: every flag documented, presets, and errors that say what to do."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tpserve.cli import apply_preset, build_parser

ROOT = Path(__file__).resolve().parents[1]
# What a launch prints once it starts Ray or the HTTP server.
NOTHING_STARTED = re.compile(r"Ray instance|ray: (started|joined)|listening on|Uvicorn")


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
                          text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)


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


def _launch_actions() -> list:
    sub = build_parser()._subparsers._group_actions[0].choices["launch"]  # noqa: SLF001
    return [a for a in sub._actions if a.option_strings and a.dest != "help"]  # noqa: SLF001


def test_version_names_tpserve_and_its_stack(tmp_path):
    import tpserve

    r = _run("--version", home=tmp_path)
    assert r.returncode == 0
    line = r.stdout.strip()
    assert line.startswith(f"tpserve {tpserve.__version__} (") and "torch " in line, line
    assert "\n" not in line


def test_every_launch_flag_has_help_text():
    missing = [a.option_strings[0] for a in _launch_actions() if not (a.help or "").strip()]
    assert not missing, f"launch flags without help text: {missing}"


def test_no_help_line_carries_two_defaults(tmp_path):
    r = _run("launch", "--help", home=tmp_path)
    assert r.returncode == 0
    # argparse wraps a flag's help over several lines: join each flag's entry first.
    entries = [e for e in re.split(r"\n(?=  -)", r.stdout.split("options:", 1)[1]) if e.strip()]
    assert len(entries) == len(_launch_actions()) + 1  # + --help
    doubled = [e for e in entries if e.count("default") > 1]
    assert not doubled, doubled
    # A flag with a fixed default shows it; one with a computed default explains it.
    by_flag = {e.split()[0]: " ".join(e.split()) for e in entries}
    assert "(default: 1)" in by_flag["--tp"]
    assert "(default: 0)" in by_flag["--seed"]
    assert "default: cores / (tp x replicas)" in by_flag["--cpus-per-shard"]
    assert "None" not in r.stdout and "(default: False)" not in r.stdout


def test_a_bare_tpserve_names_its_commands(tmp_path):
    """`tpserve` alone said "the following arguments are required: command"."""
    r = _run(home=tmp_path)
    assert r.returncode == 2
    assert "the following arguments are required: {launch,kernels}" in r.stderr, r.stderr
    r = _run("kernels", "--help", home=tmp_path)
    assert "which one --kernel auto and --quant-kernel auto pick" in " ".join(r.stdout.split())


def test_pickle_only_checkpoint_is_refused_before_anything_starts(tmp_path):
    model = tmp_path / "pickled"
    model.mkdir()
    shutil.copy(ROOT / "tpserve" / "default_model" / "config.json", model / "config.json")
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04N.")  # a pickle; never unpickled
    t0 = time.monotonic()
    r = _run("launch", "--model", str(model), home=tmp_path)
    took = time.monotonic() - t0
    assert r.returncode != 0
    assert "no *.safetensors weights" in r.stderr and "pytorch_model.bin" in r.stderr
    assert "convert" in r.stderr.lower()
    assert NOTHING_STARTED.search(r.stdout + r.stderr) is None
    assert took < 10, f"refused after {took:.1f}s"


def test_checkpoint_without_tokenizer_is_refused_before_ray(tmp_path):
    model = tmp_path / "no-tokenizer"
    model.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(ROOT / "tpserve" / "default_model" / name, model / name)
    r = _run("launch", "--model", str(model), home=tmp_path)
    assert r.returncode == 2
    assert "has no tokenizer" in r.stderr and "tokenizer.json" in r.stderr
    assert "--tokenizer ID_OR_DIR" in r.stderr  # the remedy that needs no copying
    assert NOTHING_STARTED.search(r.stdout + r.stderr) is None


def test_index_naming_missing_shards_is_refused(tmp_path):
    model = tmp_path / "partial"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "tpserve" / "default_model" / name, model / name)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    r = _run("launch", "--model", str(model), home=tmp_path)
    assert r.returncode == 2
    assert "model-00001-of-00002.safetensors, model-00002-of-00002.safetensors" in r.stderr


def test_remote_code_config_is_refused_without_suggesting_a_missing_flag(tmp_path):
    model = tmp_path / "custom"
    model.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "tpserve" / "default_model" / name, model / name)
    (model / "config.json").write_text(json.dumps({
        "model_type": "acme-custom", "architectures": ["AcmeForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_acme.AcmeConfig"}}))
    r = _run("launch", "--model", str(model), home=tmp_path)
    assert r.returncode == 2
    assert "does not run code shipped with checkpoints" in r.stderr
    assert "trust_remote_code=True" not in r.stderr
    assert NOTHING_STARTED.search(r.stdout + r.stderr) is None


def test_falcon_remote_code_config_is_refused_with_the_rewrite_that_serves_it(tmp_path):
    """Falcon's first releases (model_type RefinedWebModel, RWForCausalLM, auto_map): refused
    as any config transformers cannot read, with the rewrite into transformers' Falcon."""
    model = tmp_path / "falcon-rw"
    model.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "tpserve" / "default_model" / name, model / name)
    (model / "config.json").write_text(json.dumps({
        "model_type": "RefinedWebModel", "architectures": ["RWForCausalLM"], "n_head": 4,
        "auto_map": {"AutoConfig": "configuration_RW.RWConfig"}}))
    r = _run("launch", "--model", str(model), home=tmp_path)
    assert r.returncode == 2
    assert "does not run code shipped with checkpoints" in r.stderr
    for needle in ("'RefinedWebModel' is Falcon", "model_type falcon", "n_head -> "
                   "num_attention_heads", "n_head_kv -> num_kv_heads"):
        assert needle in " ".join(r.stderr.split()), r.stderr
    assert NOTHING_STARTED.search(r.stdout + r.stderr) is None


def test_not_found_hint_names_the_current_hub_command(tmp_path):
    r = _run("launch", "--model", "acme/not-in-cache", home=tmp_path)
    assert "`hf download acme/not-in-cache`" in r.stderr
    assert "huggingface-cli" not in r.stderr


def test_ray_colour_codes_are_dropped_when_output_is_not_a_terminal(tmp_path):
    # Ray's own printer of shard logs, before and after the CLI's stream set-up; stdout is a
    # pipe here, as under a service manager or `> log`.
    code = (
        "import sys\n"
        "from ray._private.worker import print_worker_logs\n"
        "from tpserve.cli import _plain_text_when_not_a_terminal\n"
        "batch = {'pid': 7, 'actor_name': 'shard-0', 'ip': 'h', 'localhost': 'h',"
        " 'lines': ['weights loaded']}\n"
        "print_worker_logs(batch, sys.stdout)\n"
        "_plain_text_when_not_a_terminal()\n"
        "print_worker_logs(batch, sys.stdout)\n"
        "print('\\x1b[1m\\x1b[32mhttp://127.0.0.1:8265 \\x1b[39m\\x1b[22m')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    before, after, url = r.stdout.splitlines()
    assert "\x1b[" in before  # Ray colours it by itself: the test can fail
    assert after == "(shard-0 pid=7) weights loaded"
    assert url == "http://127.0.0.1:8265 "


def _server_args(*argv: str):
    return apply_preset(build_parser(), ["launch", *argv])


def test_server_flags_and_env_keys(monkeypatch, caplog):
    from tpserve.cli import server_config

    monkeypatch.setenv("TPSERVE_API_KEY", "env-a, env-b")
    cfg = server_config(_server_args("--api-key", "flag-k", "--max-body-bytes", "1000",
                                     "--request-timeout", "2.5", "--metrics-public"))
    assert cfg.api_keys == ("flag-k", "env-a", "env-b")
    assert (cfg.max_body_bytes, cfg.request_timeout_s, cfg.metrics_public) == (1000, 2.5, True)
    assert cfg.body_budget_bytes == 4000  # --max-body-bytes-in-flight: 4 bodies by default
    cfg = server_config(_server_args("--max-body-bytes", "1000",
                                     "--max-body-bytes-in-flight", "1500"))
    assert cfg.body_budget_bytes == 1500
    assert cfg.max_best_of == 2  # TGI's --max-best-of default
    assert server_config(_server_args("--max-best-of", "4")).max_best_of == 4
    assert (cfg.responses_store_size, cfg.responses_store_mb) == (1000, 256)
    off = server_config(_server_args("--responses-store-size", "0", "--responses-store-mb", "8"))
    assert (off.responses_store_size, off.responses_store_mb) == (0, 8)
    assert cfg.responses_store_ttl_s == 3600.0
    assert server_config(_server_args("--responses-store-ttl", "0")).responses_store_ttl_s == 0
    assert server_config(_server_args("--responses-store-ttl", "90.5")
                         ).responses_store_ttl_s == 90.5
    assert "without an API key" not in caplog.text


def test_dashboard_token_note_says_how_the_ray_cli_sends_the_token(monkeypatch):
    """Ray 2.60's CLI sends the token only with RAY_AUTH_MODE=token in its own environment:
    `ray list actors --address http://127.0.0.1:8265` from another shell answered "Missing
    authentication token" although the note said the CLI reads the file."""
    from tpserve.cli import _dashboard_token_note

    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert _dashboard_token_note() == ""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    note = _dashboard_token_note()
    assert "~/.ray/auth_token" in note
    assert "`RAY_AUTH_MODE=token ray list actors --address http://127.0.0.1:8265`" in note
    assert "--address http://127.0.0.1:8266`" in _dashboard_token_note("127.0.0.1:8266")


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
    (["--max-body-bytes", "1000", "--max-body-bytes-in-flight", "999"],
     "--max-body-bytes-in-flight"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--api-key", ""], "--api-key"),
    (["--max-rebuilds", "-1"], "--max-rebuilds"),
    (["--rebuild-backoff", "-0.5"], "--rebuild-backoff"),
    (["--collective-timeout", "0"], "--collective-timeout"),
    (["--max-best-of", "0"], "--max-best-of"),
    (["--responses-store-size", "-1"], "--responses-store-size"),
    (["--responses-store-mb", "0"], "--responses-store-mb"),
    (["--responses-store-ttl", "-1"], "--responses-store-ttl"),
    (["--responses-store-ttl", "nan"], "--responses-store-ttl"),
])
def test_bad_server_flags_are_refused(monkeypatch, argv, message):
    from tpserve.cli import server_config

    monkeypatch.delenv("TPSERVE_API_KEY", raising=False)
    with pytest.raises(ValueError, match=message):
        server_config(_server_args(*argv))


@pytest.mark.parametrize("value", ["", "  ", ",", " , "])
def test_an_empty_api_key_variable_is_refused_not_an_open_server(monkeypatch, value):
    """TPSERVE_API_KEY="$KEY" with KEY unset used to start a server without a key, silently
    on loopback; `--api-key ""` was refused already."""
    from tpserve.cli import server_config

    monkeypatch.setenv("TPSERVE_API_KEY", value)
    with pytest.raises(ValueError, match="TPSERVE_API_KEY is set but holds no key"):
        server_config(_server_args())
    monkeypatch.setenv("TPSERVE_API_KEY", "k1,,k2")  # a stray comma is not an empty key
    assert server_config(_server_args()).api_keys == ("k1", "k2")


def test_rebuild_flags_reach_the_parallel_config(llama_dir):
    """A lost shard's rebuild budget, back-off and the collective timeout (a hung peer)."""
    from tpserve.cli import build_parser, engine_config

    args = build_parser().parse_args(["launch", "--model", str(llama_dir), "--device", "cpu",
                                      "--max-rebuilds", "5", "--rebuild-backoff", "0.25",
                                      "--collective-timeout", "30"])
    p = engine_config(args).parallel
    assert (p.max_rebuilds, p.rebuild_backoff_s, p.dist_timeout_s) == (5, 0.25, 30.0)
    p = engine_config(build_parser().parse_args(
        ["launch", "--model", str(llama_dir), "--device", "cpu"])).parallel
    assert (p.max_rebuilds, p.rebuild_backoff_s, p.dist_timeout_s) == (3, 1.0, 600.0)


def test_launch_starts_its_own_ray_cluster_even_when_others_run(monkeypatch):
    """Without --address, Ray's default joins the newest live local cluster (another tpserve,
    or a test's) and then refuses num_cpus; tpserve asks for a new local one."""
    import ray

    from tpserve.cli import _start_ray
    from tpserve.config import EngineConfig, ModelConfig, ParallelConfig

    seen = []

    class Ctx:
        dashboard_url = None

    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw) or Ctx())
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    cfg = EngineConfig(model=ModelConfig(path="x", model_id="x"),
                       parallel=ParallelConfig(tp_size=2, device="cpu", cpus_per_shard=1))
    args = build_parser().parse_args(["launch", "--no-dashboard"])
    _start_ray(args, cfg)
    assert seen[-1]["address"] == "local" and seen[-1]["num_cpus"] >= 3
    args = build_parser().parse_args(["launch", "--address", "auto"])
    _start_ray(args, cfg)
    assert seen[-1] == {"address": "auto", "namespace": "tpserve"}


def test_the_last_line_on_stop_says_what_of_ray_is_left(monkeypatch, capsys):
    """The launcher's last line said only "stopped", and only at --log-level info: a user
    could not tell whether the Ray processes were gone. It is printed, as the "serving" line
    is, after a local cluster's processes have been waited for."""
    import ray

    from tpserve.cli import _stop_ray

    calls = []
    monkeypatch.setattr(ray, "shutdown", lambda **kw: calls.append(kw))
    _stop_ray(None)
    assert calls == [{"wait_for_processes": True}]
    assert capsys.readouterr().out == ("tpserve: stopped (the local Ray cluster it started "
                                       "has exited)\n")
    _stop_ray("auto")
    assert capsys.readouterr().out == ("tpserve: stopped (the Ray cluster at --address auto "
                                       "keeps running)\n")


def test_a_local_cluster_is_told_it_is_one_machine_and_a_joined_one_is_not(monkeypatch):
    """Without --address, Ray is told before it is imported that the cluster is this machine
    alone, so it binds its ports to 127.0.0.1 (test_e2e_server measures the sockets); a
    cluster joined with --address spans machines and is left as it is."""
    from tpserve.cli import _ray_on_loopback

    name = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    monkeypatch.setenv(name, "unset")  # restored (removed) after the test
    _ray_on_loopback(build_parser().parse_args(["launch", "--address", "auto"]))
    assert os.environ[name] == "unset"
    _ray_on_loopback(build_parser().parse_args(["launch"]))
    assert os.environ[name] == "0"


def test_cpus_per_shard_default_reads_as_the_launch_computes_it(llama_dir, monkeypatch):
    """--help said cores / tp where the README's table, and the launch, divide the cores by
    tp x replicas."""
    from tpserve import cli

    rows = dict(re.findall(r"^\| `(--[a-z0-9-]+)` \| ([^|]*) \|",
                           (ROOT / "README.md").read_text(), re.M))
    (action,) = [a for a in _launch_actions() if a.dest == "cpus_per_shard"]
    assert f"default: {rows['--cpus-per-shard'].strip()}" in " ".join(action.help.split())
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 8)
    args = apply_preset(build_parser(), ["launch", "--model", str(llama_dir), "--device", "cpu",
                                         "--tp", "2", "--replicas", "2"])
    assert cli.engine_config(args).parallel.cpus_per_shard == 2  # 8 / (2 x 2)


# --- --kv-cache-dtype ----------------------------------------------------------------------
def test_kv_cache_dtype_bogus_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        apply_preset(build_parser(), ["launch", "--kv-cache-dtype", "bogus"])
    err = capsys.readouterr().err
    assert "--kv-cache-dtype" in err and "invalid choice: 'bogus'" in err and "fp8" in err


def test_kv_cache_dtype_fp8_reaches_the_cache_config(llama_dir):
    from tpserve.cli import engine_config

    args = apply_preset(build_parser(), ["launch", "--model", str(llama_dir),
                                         "--kv-cache-dtype", "fp8"])
    assert engine_config(args).cache.kv_cache_dtype == "fp8"
    args = apply_preset(build_parser(), ["launch", "--model", str(llama_dir)])
    assert engine_config(args).cache.kv_cache_dtype == "auto"  # the default: model dtype


def test_kv_cache_dtype_from_a_preset_is_checked(llama_dir, tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text(f"model: {llama_dir}\nkv-cache-dtype: int4\n")
    with pytest.raises(SystemExit):  # refused as the flag's own choices refuse it
        apply_preset(build_parser(), ["launch", "--config", str(preset)])
    assert "kv-cache-dtype: takes one of auto, fp8, not 'int4'" in capsys.readouterr().err


def test_kv_cache_dtype_fp8_without_float8_in_torch_is_a_start_up_error(llama_dir, monkeypatch):
    from tpserve.cli import engine_config
    from tpserve.kernels import kv_quant

    monkeypatch.setattr(kv_quant, "FP8_DTYPE", None)
    args = apply_preset(build_parser(), ["launch", "--model", str(llama_dir),
                                         "--kv-cache-dtype", "fp8"])
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs torch.float8_e4m3fn.*"
                                         "--kv-cache-dtype auto"):
        engine_config(args)


def _subcommands() -> dict:
    return build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001


def test_every_flag_of_every_subcommand_has_help_and_is_documented():
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    for name, sub in _subcommands().items():
        assert f"tpserve {name}" in (ROOT / "README.md").read_text(), name
        for action in sub._actions:  # noqa: SLF001
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[0]
            assert (action.help or "").strip(), f"tpserve {name} {flag} has no help text"
            assert f"`{flag}`" in docs or f"tpserve {name} {flag}" in docs, \
                f"tpserve {name} {flag} is in no doc"


def test_every_choice_of_a_launch_flag_is_in_its_readme_row():
    """--quantize took gptq and awq while the README's row named only auto, fp8 and none."""
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(--[a-z0-9-]+)` \|.*$",
                                                          (ROOT / "README.md").read_text(),
                                                          re.MULTILINE)}
    missing = [f"{a.option_strings[0]} {c}" for a in _launch_actions() if a.choices
               for c in a.choices if f"`{c}`" not in rows[a.option_strings[0]]
               and f"| {c} |" not in rows[a.option_strings[0]]]
    assert not missing, f"values missing from the README's flag table: {missing}"


# --- --tool-call-parser ----------------------------------------------------------------------
def test_tool_call_parser_reaches_the_server_config(capsys):
    from tpserve.cli import server_config
    from tpserve.server.tool_parsers import PARSERS

    assert server_config(_server_args()).tool_call_parser == "auto"
    assert server_config(_server_args("--tool-call-parser", "hermes")).tool_call_parser == \
        "hermes"
    choices = next(a.choices for a in build_parser()._subparsers._group_actions[0]  # noqa: SLF001
                   .choices["launch"]._actions if "--tool-call-parser" in a.option_strings)
    assert tuple(choices) == PARSERS  # the flag offers what the parser module reads
    with pytest.raises(SystemExit):
        _server_args("--tool-call-parser", "xml")
    assert "invalid choice: 'xml'" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [
    # each used to pass unchecked: a float64 or pt launch served the default, strict-x failed
    # inside the driver after Ray started, log-level loud and replicas 0 were tracebacks
    ("dtype: float64\n", "dtype: takes one of auto, float32, bfloat16, float16, not 'float64'"),
    ("load-format: pt\n", "load-format: takes one of safetensors, dummy, not 'pt'"),
    ("placement: strict-x\n", "placement: takes one of pack, spread"),
    ("log-level: loud\n", "log-level: takes one of debug, info, warning, error, not 'loud'"),
    ("replicas: 0\n", "replicas: --replicas takes a count >= 1 or auto, not '0'"),
    ("tp: 2.5\n", "tp: takes an int, not 2.5"),
    ("tp: true\n", "tp: takes a value, not True"),
    ("prefix-caching: 'no'\n", "prefix-caching: takes true or false, not 'no'"),
])
def test_a_preset_value_is_checked_as_its_flag_would_be(tmp_path, capsys, text, message):
    preset = tmp_path / "p.yaml"
    preset.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        apply_preset(build_parser(), ["launch", "--config", str(preset)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{preset}: {message}" in err, err
    assert "Traceback" not in err


def test_a_preset_value_reads_as_the_flag_would_give_it(tmp_path):
    """`replicas: 1` (a YAML int) made uses_serve() true, so one replica ran on Ray Serve;
    `api-key: K` became the list of K's letters; `revision: 1234567` reached the hub as an
    int."""
    from tpserve.cli import uses_serve

    preset = tmp_path / "p.yaml"
    preset.write_text("replicas: 1\napi-key: sk-1\nrevision: 1234567\nprefix-caching: true\n"
                      "gpu-memory-utilization: 1\nlora-modules: a=/x\n")
    args = apply_preset(build_parser(), ["launch", "--config", str(preset)])
    assert args.replicas == "1" and not uses_serve(args)
    assert args.api_key == ["sk-1"] and args.revision == "1234567" and args.prefix_caching
    assert args.lora_modules == ["a=/x"]
    assert args.gpu_memory_utilization == 1.0


def test_an_unknown_preset_key_names_the_flag_it_is_near(tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text("max_batch_sise: 8\n")
    with pytest.raises(SystemExit):
        apply_preset(build_parser(), ["launch", "--config", str(preset)])
    err = capsys.readouterr().err
    assert "unknown keys max_batch_sise (did you mean max-batch-size?)" in err, err
