"""Checks `tpserve launch` makes before Ray starts, so that a mistake on the command line is
one clear error within seconds instead of a traceback from an actor (or a hang) later.
Each raises ValueError with what to do; cli.main prints it and exits 2."""

from __future__ import annotations

import argparse
import errno
import os
import re
import socket
from importlib import metadata

# The oldest transformers tpserve is checked against (docs/troubleshooting.md says what was
# run); pyproject.toml declares the same floor (tests/test_preflight_transformers.py).
TRANSFORMERS_MIN = (4, 57)

# Launch flags and the range each must be in: (lowest, highest, lowest excluded). Checked
# after a --config preset is merged too, which argparse's own types would not see.
FLAG_RANGES: dict[str, tuple[float, float | None, bool]] = {
    "tp": (1, None, False),
    "port": (0, 65535, False),
    "cpus_per_shard": (1, None, False),
    "min_replicas": (1, None, False),
    "max_replicas": (1, None, False),
    "max_total_tokens": (2, None, False),  # one prompt token and one generated
    "max_input_tokens": (1, None, False),
    "max_concurrent_requests": (1, None, False),
    "max_batch_size": (1, None, False),
    "max_batch_tokens": (1, None, False),
    "block_size": (1, None, False),
    "num_blocks": (1, None, False),
    "kv_cache_memory_gb": (0, None, True),
    "gpu_memory_utilization": (0, 1, True),
    "shutdown_timeout": (0, None, False),
    "download_timeout": (0, None, True),
    "num_speculative_tokens": (1, 16, False),
    "ngram_max": (1, None, False),
    "ngram_min": (1, None, False),
    "speculative_max_batch": (1, None, False),
}


def check_transformers(installed: str | None = None) -> None:
    """transformers reads each checkpoint's config and tokenizer; one older than
    TRANSFORMERS_MIN misreads or refuses the configs of newer families."""
    if installed is None:
        try:
            installed = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            installed = "none"
    found = re.match(r"(\d+)\.(\d+)", installed)
    if found is None or tuple(map(int, found.groups())) < TRANSFORMERS_MIN:
        want = ".".join(map(str, TRANSFORMERS_MIN))
        raise ValueError(
            f"tpserve needs transformers >= {want}; this environment has {installed}: "
            f"pip install -U 'transformers>={want}'")


def check_ranges(args: argparse.Namespace) -> None:
    for dest, (low, high, open_low) in FLAG_RANGES.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        flag = "--" + dest.replace("_", "-")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{flag} takes a number, not {value!r}")
        # `not (a <= b)` also refuses NaN.
        ok = (value > low if open_low else value >= low) and not (high is not None
                                                                   and not value <= high)
        if not ok:
            want = (f"> {low}" if open_low else f">= {low}") + \
                (f" and <= {high}" if high is not None else "")
            raise ValueError(f"{flag} must be {want} (got {value})")


def check_token_limits(max_total: int, max_input: int | None) -> None:
    """TGI's rule: a prompt of --max-input-tokens must leave room for a generated token."""
    if max_input is not None and max_input >= max_total:
        raise ValueError(
            f"--max-input-tokens ({max_input}) must be below the max total tokens per request "
            f"({max_total}), or no token could be generated after the longest prompt: lower "
            "it, or raise --max-total-tokens")


def check_shard_count(device: str, shards: int, cpus_per_shard: int | None,
                      address: str | None, device_count: int | None) -> str | None:
    """On a cluster tpserve starts itself (no --address), every GPU shard needs a device of
    its own (CUDA, XPU): more shards than devices cannot place (ValueError). CPU shards share
    cores when there are more shards than cores: they run (tests and small machines serve
    --tp 4 on two cores), slower; the returned warning says so (None when nothing to say)."""
    if address:
        return None  # the cluster's resources decide; placement says so if they do not fit
    what = "shard" if shards == 1 else "shards"
    if device == "cpu":
        cores = os.cpu_count() or 1
        if shards > cores and cpus_per_shard is None:
            return (f"{shards} CPU {what} (--tp x --replicas) share this machine's {cores} "
                    f"core(s): every shard runs, slower than with --tp {cores} or less (pass "
                    "--cpus-per-shard to choose, or join a larger cluster with --address)")
        return None
    if device_count is not None and shards > device_count:
        mask = "CUDA_VISIBLE_DEVICES" if device == "cuda" else "ZE_AFFINITY_MASK"
        raise ValueError(
            f"{shards} {what} (--tp x --replicas) need {shards} {device.upper()} devices, one "
            f"each, but PyTorch sees {device_count} here ({mask}="
            f"{os.environ.get(mask, '(unset)')}): lower --tp, or join a Ray cluster with more "
            "devices with --address")


def check_placement(placement: str, tp: int, address: str | None) -> None:
    """strict-spread wants a node per shard; the cluster tpserve starts has one node."""
    if placement == "strict-spread" and tp > 1 and not address:
        raise ValueError(
            f"--placement strict-spread puts each of the {tp} shards on its own node, but "
            "without --address tpserve starts a one-node cluster: join a cluster of "
            f"{tp} nodes or more with --address, or use --placement pack (or spread)")


def check_port(host: str, port: int) -> None:
    """Bind host:port as the driver will (SO_REUSEADDR), then let go of it."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            hint = ("another process listens there: stop it, or pick another --port (0 picks "
                    "a free one)" if exc.errno == errno.EADDRINUSE else
                    "check --host (an address of this machine, e.g. 127.0.0.1 or 0.0.0.0)")
            raise ValueError(f"cannot listen on {host}:{port}: "
                             f"{exc.strerror or exc}; {hint}") from None


def check_ray_address(address: str | None, timeout_s: float = 3.0) -> None:
    """A HOST:PORT given to --address answers TCP (Ray itself retries a dead address for a
    minute or more). `auto` and ray:// client addresses are left to ray.init."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address takes auto or HOST:PORT (the head node's GCS port, "
                         f"6379 by default), not {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise ValueError(
            f"no Ray cluster answers at {address} ({exc.strerror or exc}): start one with "
            f"`ray start --head --port {port}` on {host}, check the address, or leave out "
            "--address to start a local cluster") from None


def check_tls_files(certfile: str | None, keyfile: str | None) -> None:
    """Load the certificate and key as the HTTP server will, so a missing file, a bad PEM or
    a key of another certificate is refused before start-up (the server cannot report it)."""
    if not certfile:
        return
    import ssl

    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        if not os.path.isfile(path):
            raise ValueError(f"{flag} {path}: no such file")

    def no_password() -> bytes:
        raise ValueError("encrypted")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile,
                                                                password=no_password)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise ValueError(
            f"--ssl-certfile {certfile} / --ssl-keyfile {keyfile} cannot be loaded ({exc}): "
            "give a PEM certificate and its unencrypted PEM private key") from None
