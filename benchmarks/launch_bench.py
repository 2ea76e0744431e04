"""Launch to ready, cold and warm: `tpserve launch` started --runs times in a row on one tree,
each run stopped once GET /health answers. Prints a table with the start-up split that the
launcher logs after its ready line, and appends it (machine, date, commit) to --out.

    python benchmarks/launch_bench.py --device cuda --dtype bfloat16 --runs 3 \
        --pycache /tmp/tpserve-pyc --out docs-bench.md --launch-args --kernel triton

Run 1 pays what a first launch pays on this machine (bytecode compiled, kernels built, page
cache empty); later runs are "warm caches". --pycache DIR sets PYTHONPYCACHEPREFIX (and
unsets PYTHONDONTWRITEBYTECODE) for every process of the launch: use it where site-packages
is read-only or bytecode writing is off (both on the lent GPU machine), where Python
otherwise compiles every imported module from source in every process of every launch (10 s
of the launcher's checks alone there, profiled). A user's own install writes its bytecode
next to the modules on first import, so this is what their second launch sees.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import tempfile
import time
from pathlib import Path

from report import emit
from serve_bench import ROOT, Server, commit_of, launch_options, machine, make_model_dir

START_UP = re.compile(r"start-up: (.*)$")


def split_of(log: Path, timeout: float = 10.0) -> str:
    """The launcher's `start-up: ...` line (logged just after the ready line)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            m = START_UP.search(line)
            if m:
                return m.group(1).strip()
        time.sleep(0.2)
    return "(no start-up line in the log)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", type=Path,
                    default=ROOT / "tests/data/configs/Meta-Llama-3-8B.json")
    ap.add_argument("--tree", default=str(ROOT), help="the checkout to launch")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--pycache", type=Path,
                    help="PYTHONPYCACHEPREFIX for every process (read-only site-packages)")
    launch_options(ap)
    args = ap.parse_args()
    # Server() reads these serve_bench options.
    args.max_batch_size, args.max_total_tokens, args.concurrency = 256, 2048, [1]
    if args.pycache:  # bytecode cached as a writable install caches it
        os.environ["PYTHONPYCACHEPREFIX"] = str(args.pycache)
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    model = make_model_dir(args.model_config, Path(tempfile.mkdtemp()) / "model")
    args.logs.mkdir(parents=True, exist_ok=True)
    tree = Path(args.tree).resolve()
    rows = []
    for run in range(1, args.runs + 1):
        log = args.logs / f"launch_{run}.log"
        srv = Server(tree, model, args, log)
        try:
            ready = srv.wait_ready(args.ready_timeout)
            split = split_of(log)
        finally:
            srv.stop()
        print(f"run {run}: ready in {ready:.1f}s; {split}", flush=True)
        rows.append((run, ready, split))
    lines = ["| run | launch to ready s | start-up split (the launcher's log line) |",
             "| --- | --- | --- |"]
    lines += [f"| {run}{' (cold)' if run == 1 else ''} | {ready:.1f} | {split} |"
              for run, ready, split in rows]
    cfg = json.loads(args.model_config.read_text())
    head = (f"Machine: {machine()}; {datetime.date.today().isoformat()}; commit "
            f"{commit_of(tree)}; tp {args.tp}, {args.dtype}, {cfg.get('model_type')} "
            f"{args.model_config.stem} (random weights), launch flags {args.launch_args}, "
            f"bytecode {'cached in ' + str(args.pycache) if args.pycache else 'as the host has it'}")
    emit(["", head, "", *lines], args.out)

if __name__ == "__main__":
    main()
