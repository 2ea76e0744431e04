"""What a failed hub download tells the user (hub.py): what went wrong and what to do, in one
line. The token itself is never part of a message; only whether one was sent."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

from tpserve.hub_stall import HubStalledError

LOGIN = "set HF_TOKEN to a token of that account (or log in once with `hf auth login`)"


def explain(exc: BaseException, model_id: str, revision: str | None, cache: str,
            endpoint: str, stalled: HubStalledError | None, flag: str = "--model") -> str:
    """The message for `exc`, raised by huggingface_hub while downloading `model_id`, which
    the user named with `flag` (--model, --tokenizer)."""
    return redact(_explain(exc, model_id, revision, cache, endpoint, stalled, flag))


def noun(flag: str) -> str:
    """What `flag` names, in a message: "model" or "tokenizer"."""
    return flag.removeprefix("--")


def redact(text: str) -> str:
    """`text` without the user and password of any URL in it (HF_ENDPOINT may be a mirror
    at https://USER:PASSWORD@HOST, and error messages quote the URLs they failed on)."""
    return re.sub(r"(\b[a-z][a-z0-9+.-]*://)[^/@\s'\"]+@", r"\1", text)


def _explain(exc: BaseException, model_id: str, revision: str | None, cache: str,
             endpoint: str, stalled: HubStalledError | None, flag: str) -> str:
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import HFValidationError

    page = f"{endpoint.rstrip('/')}/{model_id}"
    if stalled is not None:
        return stall_message(model_id, revision, cache, stalled, flag)
    if isinstance(exc, OSError) and exc.errno in CACHE_ERRNOS:
        return cache_unwritable(model_id, cache, exc)
    if isinstance(exc, HFValidationError):
        return (f"{flag} {model_id!r} is neither a directory here nor a hub id "
                f"({first_line(exc)}): a hub id looks like org/name")
    if isinstance(exc, GatedRepoError):
        if token_sent():
            return (f"{model_id} is gated and the token sent (HF_TOKEN, else `hf auth login`'s) "
                    f"has no access to it: accept its conditions on {page} with that token's "
                    "account, and wait for the grant if the authors review requests (a "
                    "fine-grained token also needs read access to gated repositories)")
        return (f"{model_id} is gated and no token was sent: accept its conditions on {page}, "
                f"then {LOGIN}")
    if isinstance(exc, RevisionNotFoundError):
        return f"{model_id} has no revision {revision!r} ({first_line(exc)})"
    status = _status(exc)
    if status == 401 and not isinstance(exc, RepositoryNotFoundError):
        return (f"{endpoint} refused the token sent for {model_id} (401: invalid or expired): "
                "set HF_TOKEN to a valid token or log in again with `hf auth login` (a public "
                "model needs no token: unset HF_TOKEN)")
    if isinstance(exc, RepositoryNotFoundError):
        private = ("the token sent (HF_TOKEN, else `hf auth login`'s) has no access to it"
                   if token_sent() else
                   f"no token was sent: {LOGIN}")
        return (f"{model_id} was not found on {endpoint}{_no_directory(model_id)}: check the "
                f"id; if it is private, {private} ({first_line(exc)})")
    if status == 429:
        return (f"{endpoint} limits the requests of this address or token (429 Too Many "
                f"Requests) while downloading {model_id}: launch again later; a token (HF_TOKEN "
                "or `hf auth login`) has a higher limit than no token")
    if status is not None and status >= 500:
        return (f"{endpoint} failed while downloading {model_id}{at(revision)} ({status}: "
                f"{first_line(exc).removeprefix('Got: ')}): the hub (or the mirror "
                "HF_ENDPOINT names) has trouble of its own; launch again later, and the files "
                f"that arrived whole stay in the hub cache {cache}")
    if status == 403:
        return (f"{endpoint} refused access to {model_id} (403): the token sent lacks the "
                "permission to read it (a fine-grained token needs read access to this "
                f"repository); use another token: {LOGIN}")
    return (f"{noun(flag)} {model_id!r}{at(revision)} is not in the hub cache {cache}"
            f"{_no_directory(model_id) if '/' not in model_id else ''} and could not be "
            f"downloaded from {endpoint}: "
            f"{first_line(exc).removeprefix('Got: ')}. Check the network (HF_ENDPOINT "
            f"selects a mirror), or fetch it where there is one (`hf download {model_id}`) "
            f"and copy the hub cache (HF_HUB_CACHE) or pass the directory to {flag}.")


# Errors of the cache's disk, not of the network: full, over quota, read-only, no access,
# a path through a file.
CACHE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                errno.ENOTDIR}


def cache_unwritable(model_id: str, cache: str, exc: OSError) -> str:
    return (f"model {model_id!r} is not in the hub cache {cache} and cannot be downloaded into "
            f"it: {exc.strerror or exc} ({exc.filename or cache}). Free space there, or set "
            "HF_HUB_CACHE (or HF_HOME) to a writable directory with room for the model; a "
            "read-only cache that holds the model needs no writing")


def no_config(model_id: str, revision: str | None, path: Path) -> str:
    """A repository without config.json: a LoRA adapter (said so, with its base), or other."""
    adapter = path / "adapter_config.json"
    if adapter.is_file():
        try:
            base = json.loads(adapter.read_text()).get("base_model_name_or_path") or "BASE"
        except (OSError, ValueError, AttributeError):
            base = "BASE"
        return (f"{model_id}{at(revision)} is a LoRA adapter (adapter_config.json), not a "
                f"model: serve its base model with --model {base} and the adapter with "
                f"--lora-modules NAME=DIR, after `hf download {model_id} --local-dir DIR`")
    return (f"{model_id}{at(revision)} has no config.json: it is not a transformers model "
            "tpserve can serve (a GGUF or ONNX export, say: serve the model it was made from)")


def stall_message(model_id: str, revision: str | None, cache: str,
                  stalled: HubStalledError, flag: str = "--model") -> str:
    return (f"{noun(flag)} {model_id!r}{at(revision)} is not in the hub cache {cache} and its "
            f"download stopped: {stalled}. Check the network, any proxy (HTTPS_PROXY, "
            "HTTP_PROXY) and HF_ENDPOINT; if the hub is only slow, allow a longer silence with "
            "--download-timeout SECONDS (or HF_HUB_DOWNLOAD_TIMEOUT); or serve without the "
            f"network: fetch it where there is one (`hf download {model_id}`), then set "
            f"HF_HUB_OFFLINE=1 with that hub cache (HF_HUB_CACHE), or pass its directory to "
            f"{flag}")


def _status(exc: BaseException | None) -> int | None:
    """The HTTP status behind `exc`: huggingface_hub wraps the error of a revision's metadata
    in LocalEntryNotFoundError ("Got: HfHubHTTPError: ...") before it reaches us."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
        exc = exc.__cause__ or exc.__context__
    return None


def token_sent() -> bool:
    """Whether huggingface_hub sends a token (HF_TOKEN, else the one `hf auth login` saved)."""
    try:
        from huggingface_hub import get_token

        return bool(get_token())
    except Exception:  # noqa: BLE001 - an old huggingface_hub: say nothing either way
        return False


def _no_directory(model_id: str) -> str:
    """A hub id may be a mistyped local directory: say that none is there either."""
    return f" (nor is {model_id} a directory here)"


def at(revision: str | None) -> str:
    return f" (revision {revision})" if revision else ""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
