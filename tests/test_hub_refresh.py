"""A branch found in the hub cache is checked against the hub on each online launch: a
repository updated on the hub is downloaded again (it kept serving yesterday's snapshot); a
hub that cannot be reached leaves the cached commit served, with a warning; a full commit id
that is cached never touches the network."""

from __future__ import annotations

import json
from pathlib import Path

from hub_server import FakeHub, SilentHub
from test_hub import hub_env, resolve_in_subprocess

ENSURE = "tpserve.hub.ensure_model"
A, B = "a" * 40, "b" * 40


def _resolve(env: dict[str, str], revision: str | None = None) -> Path:
    out = resolve_in_subprocess(env, "acme/tiny", revision, ENSURE)
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip().splitlines()[-1])


def _commit(hub: FakeHub, commit: str, files: dict[str, bytes]) -> None:
    """The repository on `hub` moves to `commit`, holding `files`."""
    hub.commit, hub.files = commit, files


def test_a_branch_updated_on_the_hub_is_downloaded_again(tmp_path, llama_dir):
    rev_a = {f.name: f.read_bytes() for f in llama_dir.iterdir()}
    config = json.loads(rev_a["config.json"])
    rev_b = {**rev_a, "config.json": json.dumps({**config, "rms_norm_eps": 1e-5}).encode()}
    with FakeHub("acme/tiny", dict(rev_a), commit=A) as hub:
        env = hub_env(tmp_path, hub)
        first = _resolve(env)
        assert first.name == A
        _commit(hub, B, rev_b)
        before = len(hub.requests)
        second = _resolve(env)
        assert second.name == B, "the cached commit was served after the branch moved"
        assert json.loads((second / "config.json").read_text())["rms_norm_eps"] == 1e-5
        # Only what changed travels again: the weights are the same blob.
        assert "model.safetensors" not in {r.rsplit("/", 1)[-1] for r in
                                           hub.requests[before:] if r.startswith("GET ")
                                           and "/resolve/" in r}
        # Up to date: one metadata request, no download.
        before = len(hub.requests)
        assert _resolve(env) == second
        asked = [r for r in hub.requests[before:] if "acme/tiny" in r]
        assert asked == ["GET /api/models/acme/tiny/revision/main"], asked
    # Offline, the branch is the commit last seen.
    assert _resolve(hub_env(tmp_path, None, offline=True)) == second


def test_an_unreachable_hub_serves_the_cached_commit_with_a_warning(tmp_path, llama_dir):
    with FakeHub.from_dir("acme/tiny", llama_dir) as hub:
        env = hub_env(tmp_path, hub)
        cached = _resolve(env)
    out = resolve_in_subprocess(env, "acme/tiny", None, ENSURE)  # the hub has stopped
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip().splitlines()[-1]) == cached
    warnings = [line for line in out.stderr.splitlines() if "cached before" in line]
    assert len(warnings) == 1, out.stderr
    assert f"serving acme/tiny at commit {cached.name}, cached before: the hub could not be " \
        "asked whether main still points there (" in warnings[0]
    with SilentHub() as silent:  # a hub that never answers: bounded by the download timeout
        env.update(HF_ENDPOINT=silent.url, HF_HUB_DOWNLOAD_TIMEOUT="1")
        out = resolve_in_subprocess(env, "acme/tiny", None, ENSURE)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip().splitlines()[-1]) == cached
    assert f"{silent.url} accepted the connection but sent no answer for 1 s" in out.stderr
    # The question is bounded by HF_HUB_ETAG_TIMEOUT (as transformers' own), not by the
    # download's longer silence bound.
    with SilentHub() as silent:
        env.update(HF_ENDPOINT=silent.url, HF_HUB_DOWNLOAD_TIMEOUT="600",
                   HF_HUB_ETAG_TIMEOUT="1")
        out = resolve_in_subprocess(env, "acme/tiny", None, ENSURE)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip().splitlines()[-1]) == cached
    assert f"{silent.url} accepted the connection but sent no answer for 1 s" in out.stderr


def test_a_cached_commit_id_never_asks_the_hub(tmp_path, llama_dir):
    with FakeHub.from_dir("acme/tiny", llama_dir) as hub:
        env = hub_env(tmp_path, hub)
        cached = _resolve(env)
        before = len(hub.requests)
        assert _resolve(env, cached.name) == cached
        assert _resolve(env, cached.name[:7]) == cached  # its short form too
        assert hub.requests[before:] == []
