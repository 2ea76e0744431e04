"""Models from the Hugging Face hub: find them in the local cache, else download them.

Only what tpserve reads is fetched: config.json, generation_config.json, the tokenizer
files, and the weight files the loader reads (weights.safetensors_files): the shards that
model.safetensors.index.json names, else model.safetensors, else the top-level *.safetensors.
Pickle-based weights (*.bin, *.pt, *.pth, *.ckpt, *.pkl), other formats (GGUF, ONNX) and
sub-folders (original/, onnx/, quantized variants) are never downloaded. huggingface_hub
does the work, so its environment variables apply: HF_TOKEN (gated and private models),
HF_ENDPOINT (a mirror), HF_HUB_CACHE / HF_HOME (where the cache is), HF_HUB_OFFLINE=1 (never
touch the network).

A hub (or proxy) that stops answering fails the download instead of hanging it: every wait on
the network (connecting, the answer to a request, the next bytes of a file) is bounded by the
download timeout (--download-timeout, else HF_HUB_DOWNLOAD_TIMEOUT, else 60 s; huggingface_hub
2.x sends some requests with no timeout at all), and a request left unanswered that long is not
sent again: the download ends with one message naming the host, the request and the wait
(huggingface_hub's own retries of timeouts would multiply the wait). The bound is on silence,
not on the total time: a large file that keeps arriving, however slowly, is never cut. Files the
hub serves through Xet are fetched by hf_xet's own client: it gets the same timeout for
connecting and for each read, and as the span it retries in (its HF_XET_CLIENT_* variables,
unless the user set them).

A branch or tag found in the cache is checked against the hub on every online launch
(hub_refresh.py): a repository updated since is downloaded again (its new files only), and a
hub that cannot be asked leaves the cached commit served, with a warning that says so.

Every node that holds a shard resolves the model itself: the first process on a node that
needs it downloads under a file lock, the others wait on the lock and then find it cached.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import logging
import math
import os
import re
from pathlib import Path

from tpserve.errors import CheckpointError
from tpserve.hub_errors import at, cache_unwritable, explain, no_config, noun, redact
from tpserve.hub_progress import DownloadProgress
from tpserve.hub_refresh import ask_timeout, current_commit, is_commit, point_ref
from tpserve.hub_stall import StallGuard, bound_xet, cancelled_by_interrupt, guarded
from tpserve.tokenizer_files import TOKENIZER_FILES, has_tokenizer

log = logging.getLogger(__name__)

# What tpserve loads. Tokenizer files vary by family: tokenizer.json / tokenizer_config.json,
# sentencepiece's tokenizer.model / spiece.model, BPE's vocab.json + merges.txt, vocab.txt.
ALLOW_PATTERNS = ["model.safetensors.index.json", "config.json",
                  "generation_config.json", "tokenizer*", "special_tokens_map.json",
                  "added_tokens.json", "vocab.json", "merges.txt", "vocab.txt", "*.model",
                  "*.tiktoken", "chat_template.json", "chat_template.jinja",
                  # quantizers' own settings files (weights.adopt_quant_file)
                  "quantize_config.json", "quant_config.json",
                  # a LoRA adapter given as --model: said to be one (hub_errors.no_config)
                  "adapter_config.json"]
# Pickle files may run code when loaded; "consolidated" files are a non-HF layout that
# duplicates the weights (Mistral's repositories carry both). The checkpoint is the
# repository's top level: sub-folders hold other copies (original/, onnx/, variants).
IGNORE_PATTERNS = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.pickle", "*.h5",
                   "*.msgpack", "consolidated*", "*/*"]
INDEX = "model.safetensors.index.json"
# --tokenizer with a hub id: its tokenizer files and chat template, never its weights;
# config.json too, which AutoTokenizer reads where tokenizer_config.json names no class.
TOKENIZER_PATTERNS = ["tokenizer*", "special_tokens_map.json", "added_tokens.json",
                      "vocab.json", "merges.txt", "vocab.txt", "*.model", "*.tiktoken",
                      "chat_template.json", "chat_template.jinja", "config.json"]


DEFAULT_DOWNLOAD_TIMEOUT_S = 60.0


def is_hub_id(model: str) -> bool:
    """`org/name` or `name`: not a path the user meant (./m, /abs, ~/m)."""
    return model.count("/") <= 1 and not model.startswith((".", "/", "~")) and bool(model)


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def weight_choices(path: Path) -> list[list[str]]:
    """Patterns of the weight files the loader reads (weights.safetensors_files), given the
    snapshot's index if it has one; several are tried in order until one gives weights."""
    index = path / INDEX
    if index.is_file():
        return [sorted(glob.escape(n) for n in set(_weight_map(index).values()))]
    return [["model.safetensors"], ["*.safetensors"]]


def cached_snapshot(model_id: str, revision: str | None = None,
                    tokenizer_only: bool = False) -> Path | None:
    """The cached snapshot holding config.json (tokenizer_only: tokenizer files), or None
    (never touches the network). Its weights may be missing (_has_weights)."""
    from huggingface_hub import snapshot_download

    try:
        path = Path(snapshot_download(model_id, revision=_full_commit(model_id, revision),
                                      local_files_only=True,
                                      allow_patterns=_patterns(tokenizer_only),
                                      ignore_patterns=IGNORE_PATTERNS))
    except Exception as exc:  # noqa: BLE001 - any miss (not cached, revision unknown) is a miss
        # huggingface_hub 2.x: the snapshot lacks files of the patterns that its listing names
        # (fetched with `hf download --include`, say). Offline, tpserve's own checks decide
        # whether it serves (check_checkpoint); online, the download completes it.
        partial = getattr(exc, "snapshot_path", None)
        if partial is None or not offline():
            return None
        path = Path(partial)
    if tokenizer_only:
        return path if has_tokenizer(path) else None
    return path if (path / "config.json").exists() else None


def _patterns(tokenizer_only: bool) -> list[str]:
    return TOKENIZER_PATTERNS if tokenizer_only else ALLOW_PATTERNS


def _full_commit(model_id: str, revision: str | None) -> str | None:
    """A short commit id (7+ hex digits, as the hub's pages show them) as the one cached
    snapshot whose commit it starts, which huggingface_hub's cache look-up does not match."""
    if revision is None or not re.fullmatch(r"[0-9a-f]{7,39}", revision):
        return revision
    snapshots = Path(cache_dir()) / f"models--{model_id.replace('/', '--')}" / "snapshots"
    found = [p.name for p in snapshots.glob(f"{revision}*") if len(p.name) == 40]
    return found[0] if len(found) == 1 else revision


def download_timeout(seconds: float | None = None) -> float:
    """Seconds of silence a download allows: `seconds` (--download-timeout), else
    HF_HUB_DOWNLOAD_TIMEOUT where the user set it, else DEFAULT_DOWNLOAD_TIMEOUT_S."""
    if seconds is not None:
        return float(seconds)
    try:
        env = float(os.environ.get("HF_HUB_DOWNLOAD_TIMEOUT", ""))
    except ValueError:
        return DEFAULT_DOWNLOAD_TIMEOUT_S
    return env if math.isfinite(env) and env > 0 else DEFAULT_DOWNLOAD_TIMEOUT_S


def ensure_model(model_id: str, revision: str | None = None, weights: bool = True,
                 timeout: float | None = None, tokenizer_only: bool = False) -> Path:
    """The local snapshot directory of `model_id` at `revision`, downloaded if missing.
    weights=False (--load-format dummy) fetches only the config and tokenizer files.
    timeout: seconds the hub may stay silent before the download fails (download_timeout).
    A cached branch or tag is served only while the hub still points it at the cached
    commit (hub_refresh); a commit id, or HF_HUB_OFFLINE, never asks the hub.
    tokenizer_only (--tokenizer): the tokenizer files of `model_id`, nothing else."""
    weights = weights and not tokenizer_only
    found = _usable(cached_snapshot(model_id, revision, tokenizer_only), weights)
    if found is not None and (offline() or is_commit(_full_commit(model_id, revision))):
        return found
    flag = "--tokenizer" if tokenizer_only else "--model"
    if offline():
        found = cached_snapshot(model_id, revision, tokenizer_only)
        where = (f"is only partly in the hub cache {cache_dir()} (its snapshot {found} lacks "
                 f"{_missing_weights(found)}: a download that stopped, or one without "
                 "weights)") if found is not None else f"is not in the hub cache {cache_dir()}"
        raise CheckpointError(
            f"{noun(flag)} {model_id!r}{at(revision)} {where} and HF_HUB_OFFLINE is set, so tpserve "
            "may not download it. Unset HF_HUB_OFFLINE to download it, fetch it first with "
            f"`hf download {model_id}{' --revision ' + revision if revision else ''}` where "
            "there is a network "
            f"(HF_HUB_CACHE selects the cache), or pass a local directory to {flag}.")
    seconds = download_timeout(timeout)
    commit = None
    if found is not None:
        commit, why = current_commit(model_id, revision, ask_timeout(seconds))
        if commit is None:
            log.warning("serving %s at commit %s, cached before: the hub could not be asked "
                        "whether %s still points there (%s)", model_id, found.name,
                        revision or "main", why)
            return found
        if commit == found.name:
            return found
        log.info("%s: %s moved on the hub from commit %s to %s", model_id, revision or "main",
                 found.name, commit)
    try:
        lock = _node_lock(model_id, revision)
        lock.acquire()
    except OSError as exc:  # a cache that is not a writable directory
        raise CheckpointError(cache_unwritable(model_id, cache_dir(), exc)) from None
    try:
        # Another process on this node may have finished the download while we waited.
        done = _usable(cached_snapshot(model_id, commit or revision, tokenizer_only), weights)
        if done is not None:
            if commit is not None:
                point_ref(cache_dir(), model_id, revision, commit)
            return done
        try:
            return _download(model_id, revision, weights, seconds, tokenizer_only)
        except CheckpointError as exc:
            if found is None:
                raise
            log.warning("serving %s at commit %s, cached before: downloading commit %s "
                        "failed (%s)", model_id, found.name, commit, exc)
            return found
    finally:
        lock.release()


def _usable(path: Path | None, weights: bool) -> Path | None:
    """`path`, a cached snapshot, where it holds what the launch reads (its weights too,
    unless weights=False), else None."""
    return path if path is not None and (not weights or _has_weights(path)) else None


def _download(model_id: str, revision: str | None, weights: bool, timeout: float,
              tokenizer_only: bool = False) -> Path:
    from huggingface_hub import constants, snapshot_download

    log.info("downloading %s%s from %s into %s (a silence of %g s fails it: "
             "--download-timeout)", model_id, at(revision), redact(constants.ENDPOINT),
             cache_dir(), timeout)
    guard = StallGuard(timeout)
    bound_xet(timeout)
    try:
        with guarded(guard), cancelled_by_interrupt(guard), _quiet_http_client(), \
                DownloadProgress(model_id, cache_dir()) as progress:
            path = Path(snapshot_download(model_id, revision=revision,
                                          allow_patterns=_patterns(tokenizer_only),
                                          ignore_patterns=IGNORE_PATTERNS))
            if tokenizer_only and not has_tokenizer(path):
                raise CheckpointError(
                    f"--tokenizer {model_id}{at(revision)} has no tokenizer files on the hub "
                    f"(none of {', '.join(TOKENIZER_FILES)}): name a repository that holds a "
                    "tokenizer, or a local directory with one")
            if not tokenizer_only and not (path / "config.json").exists():
                # refused before any weights arrive
                raise CheckpointError(no_config(model_id, revision, path))
            progress.total = _total_size(path) if weights else None
            # The weights once the index is known, at the commit just resolved.
            for patterns in weight_choices(path) if weights else []:
                with _quiet_no_match():  # "No files matched": the next choice is tried
                    snapshot_download(model_id, revision=path.name, allow_patterns=patterns,
                                      ignore_patterns=IGNORE_PATTERNS)
                if _has_weights(path):
                    break
    except CheckpointError:
        raise
    except KeyboardInterrupt:
        log.warning("download of %s interrupted: the files that arrived whole stay in the hub "
                    "cache %s, and launching again fetches only the rest", model_id, cache_dir())
        raise
    except Exception as exc:  # noqa: BLE001 - network, HTTP, hub and disk errors alike
        # guard.behind: whatever huggingface_hub made of a silence
        raise CheckpointError(explain(exc, model_id, revision, cache_dir(), constants.ENDPOINT,
                                      guard.behind(exc),
                                      "--tokenizer" if tokenizer_only else "--model")) from None
    if weights and (path / INDEX).is_file() and not _has_weights(path):
        raise CheckpointError(
            f"{model_id}{at(revision)}: its {INDEX} names weight files the repository does "
            f"not hold ({_missing_weights(path)}): pick another revision or copy of the model")
    if weights and not _has_weights(path):
        raise CheckpointError(
            f"{model_id}{at(revision)} has no *.safetensors weights (tpserve never downloads "
            "pickle *.bin files): pick a revision or a copy of the model with safetensors (the "
            "hub's conversion bot may have opened a pull request with them: --revision "
            "refs/pr/N, N from the repository's Community tab), or convert it yourself "
            "(transformers' save_pretrained writes safetensors) and pass the directory to "
            "--model")
    return path


@contextlib.contextmanager
def _quiet_http_client():
    """The HTTP client's line per request (httpx, httpx2 for huggingface_hub 2.x) only at
    debug: at info, a download's dozens of them buried the launch's own lines."""
    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    loggers = [logging.getLogger(name) for name in ("httpx", "httpx2")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(max(logger.getEffectiveLevel(), logging.WARNING))
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _quiet_no_match():
    hub_log = logging.getLogger("huggingface_hub._snapshot_download")
    no_match = logging.Filter()
    no_match.filter = lambda record: not record.getMessage().startswith("No files matched")
    hub_log.addFilter(no_match)
    try:
        yield
    finally:
        hub_log.removeFilter(no_match)


def _has_weights(path: Path) -> bool:
    index = path / INDEX
    if index.exists():
        return all((path / n).exists() for n in set(_weight_map(index).values()))
    return any(path.glob("*.safetensors"))


def _missing_weights(path: Path) -> str:
    index = path / INDEX
    if not index.is_file():
        return "its *.safetensors weights"
    missing = sorted(n for n in set(_weight_map(index).values()) if not (path / n).is_file())
    return ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")


def _total_size(path: Path) -> int | None:
    """The weights' size where the index says it (metadata.total_size)."""
    try:
        return int(json.loads((path / INDEX).read_text())["metadata"]["total_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _weight_map(index: Path) -> dict[str, str]:
    try:
        return dict(json.loads(index.read_text())["weight_map"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a safetensors index ({exc!r})") from None


def _node_lock(model_id: str, revision: str | None):
    """A lock file in the cache, so that the shards of one node download once."""
    from filelock import FileLock

    key = hashlib.sha1(f"{model_id}@{revision}".encode()).hexdigest()[:16]  # one per model
    locks = Path(cache_dir()) / ".locks" / "tpserve"
    locks.mkdir(parents=True, exist_ok=True)
    return FileLock(str(locks / f"{key}.lock"))
