"""`--model org/name` downloads from the hub (a loopback server speaking the hub's HTTP API,
started here) into an empty cache: only safetensors, config and tokenizer files, with HF_TOKEN
sent; the model then generates what transformers generates from the same files. Offline with
an empty cache fails with a message that says what to do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import FakeHub
from server_process import launched
from tiny_models import hf_greedy

import tpserve

DECOYS = {"pytorch_model.bin": b"\x80\x04pickle", "training_args.bin": b"\x80\x04",
          "original/consolidated.00.pth": b"\x80\x04", "README.md": b"# tiny\n"}


def hub_env(tmp_path: Path, hub: FakeHub | None, offline: bool = False) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub-cache"),
               HF_HUB_OFFLINE="1" if offline else "0", HF_TOKEN="hf_test_token",
               HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_DISABLE_XET="1")
    env.pop("HF_HOME", None)
    if hub is not None:
        env["HF_ENDPOINT"] = hub.url
    return env


def resolve_in_subprocess(env: dict[str, str], model: str, revision: str | None = None,
                          via: str = "tpserve.weights.resolve_model"):
    """Resolve in a fresh interpreter: huggingface_hub reads HF_* at import."""
    module, func = via.rsplit(".", 1)
    code = f"from {module} import {func}; print({func}({model!r}, {revision!r}))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)


def test_download_from_hub_then_generate(tmp_path, llama_dir):
    with FakeHub.from_dir("acme/tiny", llama_dir, DECOYS) as hub:
        env = hub_env(tmp_path, hub)
        # Two shards of one node resolving at once: the file lock lets one download.
        # (tpserve.hub alone, without torch: a fast interpreter; the CLI test below goes
        # through tpserve.weights.resolve_model.)
        code = "from tpserve.hub import ensure_model; print(ensure_model('acme/tiny'))"
        procs = [subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for _ in range(2)]
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
        paths = {Path(out.strip().splitlines()[-1]) for out, _ in outs}
        assert len(paths) == 1
        path = paths.pop()
        assert path.is_relative_to(tmp_path / "hub-cache")
        gets = [r for r in hub.requests if r.startswith("GET ") and "/resolve/" in r]
        assert len(gets) == len(set(gets)), f"a file was downloaded twice: {sorted(gets)}"
        got = hub.downloaded()
        assert "model.safetensors" in got and "config.json" in got
        assert {"tokenizer.json", "tokenizer_config.json"} <= got
        assert not got & set(DECOYS), f"pickle/unneeded files fetched: {got & set(DECOYS)}"
        assert "Bearer hf_test_token" in hub.auth
        # A second resolution, offline now, finds the snapshot without the network.
        before = len(hub.requests)
        again = resolve_in_subprocess(hub_env(tmp_path, hub, offline=True), "acme/tiny", None,
                                      "tpserve.hub.ensure_model")
        assert again.returncode == 0, again.stderr
        assert Path(again.stdout.strip().splitlines()[-1]) == path
        assert len(hub.requests) == before
    from engine_utils import greedy, make_engine

    engine = make_engine(path, 1, local=True)
    try:
        ours = greedy(engine, ["Hello world", "The quick brown fox"], 8)
    finally:
        engine.shutdown()
    assert ours == hf_greedy(path, ["Hello world", "The quick brown fox"], 8)


def _two_shards(llama_dir: Path) -> dict[str, bytes]:
    """llama_dir's weights as two shards and their index."""
    from safetensors.torch import load_file, save

    tensors = load_file(str(llama_dir / "model.safetensors"))
    names = sorted(tensors)
    half = {"model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2]}
    files = {shard: save({n: tensors[n] for n in part}) for shard, part in half.items()}
    index = {"metadata": {}, "weight_map": {n: s for s, part in half.items() for n in part}}
    files["model.safetensors.index.json"] = json.dumps(index).encode()
    return files


# Files a repository may hold that serving never reads: other formats, copies in sub-folders,
# an adapter, a half-precision duplicate, a model card's images.
UNNEEDED = {"model.gguf": b"gguf", "model.fp16.safetensors": b"dup", "tf_model.h5": b"h5",
            "adapter_model.safetensors": b"adapter", "onnx/model.onnx": b"onnx",
            "onnx/model.safetensors": b"onnx", "onnx/tokenizer.json": b"{}",
            "gptq-4bit/model.safetensors": b"q", "original/consolidated.00.pth": b"pth",
            "original/tokenizer.model": b"sp", "assets/banner.png": b"png" * 1000,
            "consolidated.safetensors": b"mistral", "pytorch_model.bin": b"\x80\x04"}


def test_only_the_weight_files_the_loader_reads_are_downloaded(tmp_path, llama_dir):
    """A sharded repository: the shards its index names, none of the other *.safetensors
    (a stray model.safetensors, an adapter, sub-folders) nor other formats. Without an
    index: model.safetensors alone. Offline, the snapshot is then found whole."""
    meta = {f.name: f.read_bytes() for f in llama_dir.iterdir()
            if f.is_file() and f.suffix != ".safetensors"}
    sharded = {**meta, **_two_shards(llama_dir), **UNNEEDED, "model.safetensors": b"stray"}
    with FakeHub("acme/sharded", sharded) as hub:
        out = resolve_in_subprocess(hub_env(tmp_path, hub), "acme/sharded", None,
                                    "tpserve.hub.ensure_model")
        assert out.returncode == 0, out.stderr
        got = hub.downloaded()
    assert got == set(meta) | set(_two_shards(llama_dir)), sorted(got)
    again = resolve_in_subprocess(hub_env(tmp_path, None, offline=True), "acme/sharded", None,
                                  "tpserve.hub.ensure_model")
    assert again.returncode == 0, again.stderr
    single = {**meta, "model.safetensors": (llama_dir / "model.safetensors").read_bytes(),
              **UNNEEDED}
    with FakeHub("acme/single", single) as hub:
        out = resolve_in_subprocess(hub_env(tmp_path, hub), "acme/single", None,
                                    "tpserve.hub.ensure_model")
        assert out.returncode == 0, out.stderr
        assert hub.downloaded() == set(meta) | {"model.safetensors"}, sorted(hub.downloaded())
        assert "No files matched" not in out.stderr


def test_a_launch_logs_no_http_request_lines_at_info(tmp_path, llama_dir):
    """huggingface_hub 2.x's client (httpx2) logged one INFO line per request, dozens per
    download; a repository without safetensors fails right after its download, before Ray."""
    files = {f.name: f.read_bytes() for f in llama_dir.iterdir() if f.suffix != ".safetensors"}
    with FakeHub("acme/pickled", {**files, "pytorch_model.bin": b"\x80\x04"}) as hub:
        out = subprocess.run([sys.executable, "-m", "tpserve.cli", "launch", "--model",
                              "acme/pickled"], env=hub_env(tmp_path, hub),
                             capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "has no *.safetensors weights" in out.stderr
    assert "--revision refs/pr/N" in out.stderr and "convert it yourself" in out.stderr
    assert "HTTP Request:" not in out.stderr, out.stderr


def test_a_repository_without_a_tokenizer_says_what_to_do(tmp_path, llama_dir):
    """config.json and weights but no tokenizer: the message said to copy the tokenizer
    into the hub cache's snapshot; it now names the repository and a directory to serve."""
    files = {f.name: f.read_bytes() for f in llama_dir.iterdir()
             if not f.name.startswith("tokenizer")}
    with FakeHub("acme/no-tok", files) as hub:
        out = subprocess.run([sys.executable, "-m", "tpserve.cli", "launch", "--model",
                              "acme/no-tok", "--load-format", "dummy"],
                             env=hub_env(tmp_path, hub), capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith("tpserve: error: acme/no-tok has no tokenizer on the hub"), err
    assert "`hf download acme/no-tok --local-dir DIR`" in err and "--model DIR" in err
    assert "--tokenizer ID_OR_DIR" in err


def test_revision_and_missing_repo_errors(tmp_path, llama_dir):
    with FakeHub.from_dir("acme/tiny", llama_dir) as hub:
        env = hub_env(tmp_path, hub)
        hub_only = "tpserve.hub.ensure_model"  # no torch import: a faster subprocess
        out = resolve_in_subprocess(env, "acme/tiny", "c" * 40, hub_only)
        assert out.returncode == 0, out.stderr
        assert (Path(out.stdout.strip()) / "model.safetensors").exists()
        # Offline, a commit as the hub's pages show it (its first 7 digits) finds the cached
        # snapshot too; it was "not in the hub cache".
        offline = hub_env(tmp_path, None, offline=True)
        short = resolve_in_subprocess(offline, "acme/tiny", "c" * 7, hub_only)
        assert short.returncode == 0, short.stderr
        assert short.stdout.strip() == out.stdout.strip()
        bad_rev = resolve_in_subprocess(env, "acme/tiny", "v9", hub_only)
        assert bad_rev.returncode != 0 and "has no revision 'v9'" in bad_rev.stderr
        missing = resolve_in_subprocess(env, "acme/nope", None, hub_only)
        assert missing.returncode != 0
        assert "acme/nope was not found on " + hub.url in missing.stderr
        assert "HF_TOKEN" in missing.stderr


@pytest.mark.parametrize("revision", ["v1.0", "refs/pr/1"])
def test_a_tag_or_pull_request_revision_is_downloaded_and_then_served_offline(tmp_path,
                                                                             llama_dir,
                                                                             revision):
    """--revision names a tag, or refs/pr/N (what the missing-safetensors message suggests):
    the snapshot of the commit it names, found again offline under the same name."""
    commit = "d" * 40
    with FakeHub.from_dir("acme/tiny", llama_dir) as hub:
        hub.commit, hub.refs = commit, (revision,)
        out = resolve_in_subprocess(hub_env(tmp_path, hub), "acme/tiny", revision,
                                    "tpserve.hub.ensure_model")
        assert out.returncode == 0, out.stderr
        path = Path(out.stdout.strip().splitlines()[-1])
        assert path.name == commit and (path / "model.safetensors").is_file()
        assert not any("/resolve/main/" in r for r in hub.requests), hub.requests
    offline = resolve_in_subprocess(hub_env(tmp_path, None, offline=True), "acme/tiny",
                                    revision, "tpserve.hub.ensure_model")
    assert offline.returncode == 0, offline.stderr
    assert Path(offline.stdout.strip().splitlines()[-1]) == path
    other = resolve_in_subprocess(hub_env(tmp_path, None, offline=True), "acme/tiny", "v2",
                                  "tpserve.hub.ensure_model")
    assert "'acme/tiny' (revision v2) is not in the hub cache" in other.stderr, other.stderr


def test_token_errors_say_what_went_wrong_and_what_to_do(tmp_path, llama_dir):
    """A gated repository without a token, or with a token that has no access; a token the
    hub refuses (was "could not be downloaded ... Check the network"); a private or missing
    repository; an id that is no hub id (was "Check the network" too). Each one line, exit
    2, naming the token's source and `hf auth login`, never the token itself."""
    hub_only = "tpserve.hub.ensure_model"
    with FakeHub.from_dir("acme/gated", llama_dir) as hub:
        hub.tokens, hub.granted = {"hf_test_token", "hf_granted"}, {"hf_granted"}
        env = hub_env(tmp_path, hub)
        no_token = {k: v for k, v in env.items() if k != "HF_TOKEN"}
        no_token["HF_TOKEN_PATH"] = str(tmp_path / "no-saved-token")
        out = subprocess.run([sys.executable, "-m", "tpserve.cli", "launch", "--model",
                              "acme/gated"], env=no_token, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        err = out.stderr.strip().splitlines()[-1]
        assert err.startswith("tpserve: error: acme/gated is gated and no token was sent"), err
        assert f"{hub.url}/acme/gated" in err and "`hf auth login`" in err and "HF_TOKEN" in err
        out = resolve_in_subprocess(env, "acme/gated", None, hub_only)
        assert "is gated and the token sent (HF_TOKEN, else `hf auth login`'s) has no access" \
            in out.stderr, out.stderr
        env["HF_TOKEN"] = "hf_expired"
        out = resolve_in_subprocess(env, "acme/gated", None, hub_only)
        assert f"{hub.url} refused the token sent for acme/gated (401: invalid or expired)" \
            in out.stderr, out.stderr
        assert "`hf auth login`" in out.stderr and "hf_expired" not in out.stderr
        env["HF_TOKEN"] = "hf_granted"
        assert resolve_in_subprocess(env, "acme/gated", None, hub_only).returncode == 0
        out = resolve_in_subprocess(env, "models/llama", None, hub_only)
        assert f"models/llama was not found on {hub.url} (nor is models/llama a directory " \
            "here): check the id; if it is private, the token sent (HF_TOKEN" in out.stderr
        out = resolve_in_subprocess(env, "acme/tiny@main", None, hub_only)
        assert "'acme/tiny@main' is neither a directory here nor a hub id" in out.stderr
        assert "network" not in out.stderr.splitlines()[-1]
    assert "hf_granted" not in out.stderr


def test_offline_with_a_snapshot_lacking_its_weights_says_so(tmp_path, llama_dir):
    """A snapshot with config and tokenizer but no weights (a download that stopped, or one
    for --load-format dummy), then offline: it said the model "is not in the hub cache"."""
    meta = {f.name: f.read_bytes() for f in llama_dir.iterdir() if f.suffix != ".safetensors"}
    with FakeHub("acme/sharded", {**meta, **_two_shards(llama_dir)}) as hub:
        code = ("from tpserve.hub import ensure_model; "
                "print(ensure_model('acme/sharded', weights=False))")
        out = subprocess.run([sys.executable, "-c", code], env=hub_env(tmp_path, hub),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
    snapshot = out.stdout.strip().splitlines()[-1]
    out = resolve_in_subprocess(hub_env(tmp_path, None, offline=True), "acme/sharded", None,
                                "tpserve.hub.ensure_model")
    assert out.returncode != 0
    assert (f"'acme/sharded' is only partly in the hub cache {tmp_path / 'hub-cache'} (its "
            f"snapshot {snapshot} lacks model-00001-of-00002.safetensors, "
            "model-00002-of-00002.safetensors: a download that stopped") in out.stderr, out.stderr
    assert "HF_HUB_OFFLINE is set" in out.stderr


def test_a_revision_that_cannot_apply_is_said_to_be_ignored(tmp_path, monkeypatch, caplog,
                                                           llama_dir):
    """--revision with a local directory (or without --model) was silently ignored: a
    directory named like the hub id (acme/tiny under the working directory) is served as it
    is, and the log now says so."""
    import logging
    import shutil

    from tpserve.weights import resolve_model

    shutil.copytree(llama_dir, tmp_path / "acme" / "tiny")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="tpserve.weights"):
        assert resolve_model("acme/tiny", "v2") == tmp_path / "acme" / "tiny"
        resolve_model(None, "v2")
    assert (f"--revision v2 is ignored: {tmp_path / 'acme' / 'tiny'} is a local directory, "
            "served as it is; it shadows the hub id acme/tiny") in caplog.text
    assert "--revision v2 is ignored: it selects a revision of a hub id" in caplog.text
    caplog.clear()
    resolve_model("acme/tiny")
    assert "ignored" not in caplog.text


def test_offline_a_snapshot_without_an_optional_file_still_serves(tmp_path, llama_dir):
    """A snapshot fetched with `hf download ID --include "*.json" "*.safetensors"`: no
    tokenizer.model beside tokenizer.json. huggingface_hub 2.x's cache look-up calls it
    incomplete, and offline tpserve said the model "is not in the hub cache"."""
    files = {f.name: f.read_bytes() for f in llama_dir.iterdir()}
    with FakeHub("acme/tiny", {**files, "tokenizer.model": b"sentencepiece"}) as hub:
        out = resolve_in_subprocess(hub_env(tmp_path, hub), "acme/tiny", None,
                                    "tpserve.hub.ensure_model")
    assert out.returncode == 0, out.stderr
    snapshot = Path(out.stdout.strip().splitlines()[-1])
    (snapshot / "tokenizer.model").unlink()
    again = resolve_in_subprocess(hub_env(tmp_path, None, offline=True), "acme/tiny", None,
                                  "tpserve.hub.ensure_model")
    assert again.returncode == 0, again.stderr
    assert Path(again.stdout.strip().splitlines()[-1]) == snapshot


@pytest.mark.parametrize("status,needle", [
    (429, "limits the requests of this address or token (429 Too Many Requests)"),
    (503, "failed while downloading acme/tiny (503: "),
])
def test_a_hub_that_refuses_for_its_own_reasons_is_not_the_network(status, needle):
    """A rate limit or a failing hub read "could not be downloaded ... Check the network"."""
    from types import SimpleNamespace

    from tpserve.hub_errors import explain

    cause = OSError(f"{status} error for url https://hub/api/models/acme/tiny")
    cause.response = SimpleNamespace(status_code=status)  # as on huggingface_hub's errors
    exc = LookupError(f"Got: {cause}")  # as huggingface_hub wraps a revision's metadata error
    exc.__cause__ = cause
    text = explain(exc, "acme/tiny", None, "/cache", "https://hub", None)
    assert needle in text and "Check the network" not in text, text
    assert "launch again later" in text


def test_an_adapter_or_export_repository_is_refused_before_its_weights(tmp_path):
    """A repository without config.json: a LoRA adapter (named as such, with its base) or a
    GGUF export. Its weights were downloaded before the refusal."""
    adapter = {"adapter_config.json": b'{"base_model_name_or_path": "acme/base", "r": 8}',
               "adapter_model.safetensors": b"lora" * 1000, "README.md": b"# lora\n"}
    with FakeHub("acme/lora", adapter) as hub:
        out = resolve_in_subprocess(hub_env(tmp_path, hub), "acme/lora", None,
                                    "tpserve.hub.ensure_model")
        assert "adapter_model.safetensors" not in hub.downloaded()
    assert out.returncode != 0
    assert ("acme/lora is a LoRA adapter (adapter_config.json), not a model: serve its base "
            "model with --model acme/base and the adapter with --lora-modules NAME=DIR, after "
            "`hf download acme/lora --local-dir DIR`") in out.stderr, out.stderr
    with FakeHub("acme/gguf", {"model.Q4_K_M.gguf": b"gguf", "x.safetensors": b"x"}) as hub:
        out = resolve_in_subprocess(hub_env(tmp_path, hub), "acme/gguf", None,
                                    "tpserve.hub.ensure_model")
        assert not hub.downloaded()
    assert "acme/gguf has no config.json: it is not a transformers model" in out.stderr


def test_dummy_weights_fetch_no_safetensors(tmp_path, llama_dir):
    # Quantizers' own settings files come too: weights.adopt_quant_file reads them where
    # config.json has no quantization_config.
    quant_files = {"quantize_config.json": b'{"bits": 4, "group_size": 128}',
                   "quant_config.json": b'{"w_bit": 4, "q_group_size": 128}'}
    with FakeHub.from_dir("acme/tiny", llama_dir, quant_files) as hub:
        code = ("from tpserve.hub import ensure_model; "
                "print(ensure_model('acme/tiny', None, weights=False))")
        out = subprocess.run([sys.executable, "-c", code], env=hub_env(tmp_path, hub),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert "config.json" in hub.downloaded()
        assert not any(f.endswith(".safetensors") for f in hub.downloaded())
        assert set(quant_files) <= hub.downloaded()


def test_a_node_without_the_directory_resolves_the_hub_id(tmp_path, monkeypatch, llama_dir):
    from tpserve import hub
    from tpserve.errors import CheckpointError
    from tpserve.weights import node_model_path

    asked = []
    monkeypatch.setattr(hub, "ensure_model", lambda *a: asked.append(a) or llama_dir)
    assert node_model_path(str(llama_dir), "acme/tiny") == llama_dir  # shared path: used
    assert asked == []
    gone = str(tmp_path / "on-the-head-node-only")
    assert node_model_path(gone, "acme/tiny", "v1", False) == llama_dir
    assert asked == [("acme/tiny", "v1", False, None)]
    snapshot = tmp_path / "models--acme--tiny" / "snapshots" / ("d" * 40)
    node_model_path(str(snapshot), "acme/tiny", "main")  # the launching node's commit wins
    assert asked[-1] == ("acme/tiny", "d" * 40, True, None)
    node_model_path(gone, "acme/tiny", None, True, 7.5)  # --download-timeout reaches the node
    assert asked[-1] == ("acme/tiny", None, True, 7.5)
    with pytest.raises(CheckpointError, match="file system every node mounts"):
        node_model_path(gone, "/data/models/tiny")


def test_offline_with_empty_cache_says_what_to_do(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tpserve.cli", "launch", "--model",
                          "acme/tiny"], env=hub_env(tmp_path, None, offline=True),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    err = out.stderr
    assert "'acme/tiny' is not in the hub cache" in err and "HF_HUB_OFFLINE" in err
    assert "hf download acme/tiny" in err and "local directory" in err


def test_unreachable_hub_says_the_model_is_not_cached_and_what_to_do(tmp_path):
    """No network (not offline mode): the message used to be huggingface_hub's "Got:
    ConnectError: ..." and never said that the cache had been looked in, nor where."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = hub_env(tmp_path, None)
    env["HF_ENDPOINT"] = endpoint
    out = resolve_in_subprocess(env, "acme/tiny", None, "tpserve.hub.ensure_model")
    assert out.returncode != 0
    err = out.stderr.strip().splitlines()[-1]
    assert f"'acme/tiny' is not in the hub cache {tmp_path / 'hub-cache'}" in err
    assert f"could not be downloaded from {endpoint}" in err and "Got:" not in err
    assert "`hf download acme/tiny`" in err and "--model" in err
    # A bare name may be a mistyped local directory: say that none is there either.
    out = resolve_in_subprocess(env, "my-model", None, "tpserve.hub.ensure_model")
    assert "(nor is my-model a directory here)" in out.stderr


def test_a_password_in_hf_endpoint_is_never_shown(tmp_path, llama_dir):
    """A mirror at http://USER:PASSWORD@HOST: the download's log line and its error messages
    quoted HF_ENDPOINT (and the URLs that failed) whole."""
    import socket

    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = hub_env(tmp_path, None)
    env["HF_ENDPOINT"] = f"http://bob:s3cret@127.0.0.1:{port}"
    out = subprocess.run([sys.executable, "-m", "tpserve.cli", "launch", "--model",
                          "acme/tiny"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"could not be downloaded from http://127.0.0.1:{port}" in out.stderr, out.stderr
    assert "s3cret" not in out.stderr and "bob" not in out.stderr, out.stderr
    with FakeHub.from_dir("acme/tiny", llama_dir) as hub:
        env["HF_ENDPOINT"] = hub.url.replace("://", "://bob:s3cret@")
        out = resolve_in_subprocess(env, "acme/nope", None, "tpserve.hub.ensure_model")
    assert f"acme/nope was not found on {hub.url} " in out.stderr, out.stderr
    assert "s3cret" not in out.stderr


def test_a_cache_that_cannot_be_written_says_so(tmp_path):
    """HF_HUB_CACHE through a file (or read-only, or full): a traceback from the lock's
    mkdir, and a full disk read "could not be downloaded ... Check the network"."""
    import errno

    from tpserve.hub_errors import explain

    (tmp_path / "a-file").write_text("")
    env = hub_env(tmp_path, None)
    env.update(HF_HUB_CACHE=str(tmp_path / "a-file" / "cache"), HF_ENDPOINT="http://127.0.0.1:9")
    out = subprocess.run([sys.executable, "-m", "tpserve.cli", "launch", "--model",
                          "acme/tiny"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    err = out.stderr.strip().splitlines()[-1]
    assert "cannot be downloaded into it: Not a directory" in err and "HF_HUB_CACHE" in err
    full = OSError(errno.ENOSPC, "No space left on device", "/cache/blobs/x.incomplete")
    text = explain(full, "acme/tiny", None, "/cache", "https://hub", None)
    assert "cannot be downloaded into it: No space left on device (/cache/blobs/" in text
    assert "network" not in text


@pytest.mark.slow
def test_launch_serves_a_model_downloaded_from_the_hub(tmp_path, llama_dir):
    from transformers import AutoTokenizer

    ref = hf_greedy(llama_dir, ["Hello world"], 10)[0]
    text = AutoTokenizer.from_pretrained(llama_dir).decode(ref, skip_special_tokens=True)
    with FakeHub.from_dir("acme/tiny", llama_dir, DECOYS) as hub:
        env = hub_env(tmp_path, hub)
        with launched(["--model", "acme/tiny", "--tp", "2", "--num-blocks", "64"],
                      tmp_path / "server.log", env=env) as url:
            r = tpserve.Client(url, timeout=60).generate("Hello world", max_new_tokens=10)
        assert r.generated_text == text
        assert not hub.downloaded() & set(DECOYS)
    # One line per downloaded file from the HTTP client at INFO buried the launch's own
    # lines; they show at --log-level debug.
    log = (tmp_path / "server.log").read_text()
    assert "HTTP Request:" not in log, log[:2000]


def test_a_tokenizer_hub_id_that_cannot_be_had_names_the_tokenizer_flag(tmp_path):
    """--tokenizer ORG/NAME offline and not cached, or with no hub to reach: the message
    called it a model and said to pass a directory to --model."""
    import socket

    code = "from tpserve.hub import ensure_model; ensure_model('acme/tok', tokenizer_only=True)"
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    online = hub_env(tmp_path, None)
    online["HF_ENDPOINT"] = endpoint
    for env in (hub_env(tmp_path, None, offline=True), online):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, timeout=120)
        err = out.stderr.strip().splitlines()[-1]
        assert out.returncode != 0 and "tokenizer 'acme/tok'" in err, err
        assert "--tokenizer" in err and "--model" not in err, err
