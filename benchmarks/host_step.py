"""Host (Python) cost of one decode step outside the model runner, on the CPU: the real
scheduler, block manager, prefix cache, step building and output processor driven by a fake
executor that returns a fixed token stream at once. Prints ms per step for each part at
batch 32 and 256, for this tree and (with --old PATH, e.g. a `git archive` of an earlier
commit) for another tree side by side, with the ratio old / new, and writes the table into
docs/benchmarks.md.

    python benchmarks/host_step.py [--old /tmp/main-tree] [--steps 48] [--out FILE]

Each tree is measured in its own subprocess (its own `tpserve` import). The workload is the
served benchmark's shape: 256-token prompts (distinct, so nothing is shared), greedy,
ignore_eos; a quarter of the requests carry a stop string TGI-style (kept in the text) and a
quarter OpenAI-style (cut), so the stop-string paths are paid for too. Outputs cross a pickle
as the engine-core actor's poll does (pack, pickle, unpickle, unpack).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("schedule", "build", "after_step", "append", "pack", "process", "stats")
PART_DOC = {
    "schedule": "Scheduler.schedule (block manager can_grow/grow)",
    "build": "the per-sequence step messages (_seq_step)",
    "after_step": "Scheduler.after_step (prefix-cache block hashing)",
    "append": "the rest of EngineCore.step (appending tokens, EOS/length)",
    "pack": "pack_outputs + pickle + unpickle (the engine-core actor's poll to the driver)",
    "process": "the driver's output processing as CoreClient.step does it (unpack_outputs + "
               "OutputProcessor.process, or process_packed where the tree has it: "
               "detokenizer, stop strings, events)",
    "stats": "EngineCore.stats (the engine-core actor's poll computes it; it now does so at "
             "most every 0.1 s while busy)",
    "bridge": "a separate run: AsyncEngine handing each step's events from the engine thread "
              "to one asyncio consumer per request (an engine that answers at once), wall "
              "ms per step",
}


READING = """\
What the host-path work (issue 7) changed, part by part: the scheduler skips the block
manager's allocation when a decode step needs no new block and works out a sequence's
block need once (schedule); the prefix cache hashes each block once, from slices of the
prompt and output, and looks at a sequence's blocks again only after an eviction that could
change the answer (after_step); stop strings are searched only when a token adds text and
the OpenAI hold-back no longer rescans the whole text (process); the driver walks the packed
arrays without building a TokenOutput per token (process, pack); the engine-core actor
recomputes its gauges at most every 0.1 s while busy (stats, not in this table's loop); one
event-loop wake-up per step instead of one per token (bridge); and serving freezes the
start-up heap, so the garbage collector's full passes no longer walk the model's objects
(the mean total, whose pauses the median hides). build and append are the engine core's
step path (the overlapped-steps work), unchanged here. Absolute times are this shared CPU's;
compare the ratios, and measure on the GPU host for its numbers."""


# --- measuring one tree (runs in a subprocess with that tree first on sys.path) -----------
class _Timer:
    def __init__(self) -> None:
        self.acc = dict.fromkeys(PARTS, 0.0)

    def wrap(self, obj, name: str, part: str) -> None:
        """Time obj.name into `part` (an instance attribute shadows the method)."""
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.acc[part] += time.perf_counter() - t0

        setattr(obj, name, timed)


def _fake_executor(token_stream: list[int]):
    from tpserve.engine.step import SampledToken, StepOutput
    from tpserve.executor.base import Executor

    class FakeExecutor(Executor):
        """Every sampled row gets the next token of a fixed stream, at once."""

        def start(self):
            # The shards' real report type, so fields the engine reads later exist.
            from tpserve.worker.worker import LoadReport

            return [LoadReport(rank=0, seconds=0.0, param_bytes=0, backend="fake")]

        def available_blocks(self) -> int:
            return 1 << 15

        def allocate_cache(self, num_blocks: int) -> None: ...

        def warmup(self, batch_sizes) -> float:
            return 0.0

        def execute_step(self, batch):
            n = len(token_stream)
            return StepOutput(batch.step_id, [
                SampledToken(s.seq_id, token_stream[(s.seq_id * 31 + s.num_generated) % n], -0.5)
                for s in batch.seqs if s.sample])

        def health(self, timeout_s: float = 10.0):
            return [{}]

        def shutdown(self) -> None: ...

    return FakeExecutor()


def _tokenizer(vocab: int):
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_models import build_tokenizer

    return build_tokenizer(vocab)


def measure(batch: int, steps: int, prompt_len: int, prefix_caching: bool) -> dict:
    from tpserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from tpserve.engine.core import EngineCore
    from tpserve.engine.output_processor import OutputProcessor
    from tpserve.engine.outputs import pack_outputs, unpack_outputs
    from tpserve.engine.request import SamplingParams

    tok = _tokenizer(512)
    special = frozenset(tok.all_special_ids)
    rng = random.Random(0)
    usable = [i for i in range(len(tok)) if i not in special]
    stream = [rng.choice(usable) for _ in range(4096)]
    new = steps + 16
    cfg = EngineConfig(
        model=ModelConfig(path="unused", model_id="host-step", max_model_len=prompt_len + new + 8),
        cache=CacheConfig(block_size=16, prefix_caching=prefix_caching),
        # Every prompt in one step: main before this change failed on a chunked prefill
        # with prefix caching (it named blocks past the computed ones).
        scheduler=SchedulerConfig(max_num_seqs=batch,
                                  max_num_batched_tokens=max(8192, batch * prompt_len),
                                  max_concurrent_requests=batch))
    hf = type("HF", (), {"architectures": ["LlamaForCausalLM"]})()
    core = EngineCore(cfg, _fake_executor(stream), hf, eos_ids={tok.eos_token_id})
    proc = OutputProcessor(tok, special)
    styles = [SamplingParams(max_new_tokens=new, ignore_eos=True),
              SamplingParams(max_new_tokens=new, ignore_eos=True, stop=("@@@", "\n\n\n")),
              SamplingParams(max_new_tokens=new, ignore_eos=True),
              SamplingParams(max_new_tokens=new, ignore_eos=True, stop=("@@@", "\n\n\n"),
                             include_stop_str_in_output=False)]
    for i in range(batch):
        seq = core.add_request([rng.choice(usable) for _ in range(prompt_len)], styles[i % 4])
        proc.add(seq.seq_id, seq.params)

    try:  # what serving does once a replica is built, in trees that do it
        from tpserve.engine.heap import freeze_startup_objects

        freeze_startup_objects()
    except ImportError:
        pass
    timer = _Timer()
    timer.wrap(core.scheduler, "schedule", "schedule")
    timer.wrap(core.scheduler, "after_step", "after_step")
    timer.wrap(core, "_seq_step", "build")
    per_step: dict[str, list[float]] = {p: [] for p in (*PARTS, "total")}

    def one_step(record: bool) -> int:
        timer.acc = dict.fromkeys(PARTS, 0.0)
        t0 = time.perf_counter()
        outputs, _ = core.step()
        t1 = time.perf_counter()
        packed = pickle.loads(pickle.dumps(pack_outputs(outputs)))
        t2 = time.perf_counter()
        if hasattr(proc, "process_packed"):
            events, stopped = proc.process_packed(packed)
        else:
            events, stopped = proc.process(unpack_outputs(packed))
        for seq_id in stopped:
            core.finish(seq_id, "stop_sequence")
        t3 = time.perf_counter()
        core.stats()
        t4 = time.perf_counter()
        if record:
            acc = timer.acc
            acc["append"] = (t1 - t0) - acc["schedule"] - acc["build"] - acc["after_step"]
            acc["pack"], acc["process"], acc["stats"] = t2 - t1, t3 - t2, t4 - t3
            for p in PARTS:
                per_step[p].append(acc[p] * 1e3)
            per_step["total"].append((t4 - t0) * 1e3)
        return len(events)

    while any(not s.seq.output_ids for s in core.requests.values()):  # prefill
        one_step(False)
    for _ in range(4):  # warm
        one_step(False)
    for _ in range(steps):
        if one_step(True) != batch:
            raise RuntimeError("a request finished early: the timed steps must be full")
    res = {p: statistics.median(v) for p, v in per_step.items()}
    res["mean"] = statistics.fmean(per_step["total"])  # with the garbage collector's pauses
    return res


def measure_bridge(batch: int, steps: int) -> float:
    """ms per step of AsyncEngine (the engine thread handing events to asyncio consumers)
    under an engine whose step returns prebuilt events at once: the driver's cost per step
    before HTTP, with the engine thread and the event loop sharing one interpreter."""
    import asyncio
    from types import SimpleNamespace

    from tpserve.engine.async_engine import AsyncEngine
    from tpserve.engine.request import GenerationEvent, SamplingParams, TokenInfo

    class FakeEngine:
        def __init__(self) -> None:
            self.live: dict[int, int] = {}
            self.next_id = 0
            info = TokenInfo(5, "x", -0.5)
            self.mid = GenerationEvent(info)
            self.last = GenerationEvent(info, finished=True, generated_text="x" * steps,
                                        finish_reason="length")

        def tokenize(self, prompt, truncate=None, add_special_tokens=True):
            return [1, 2, 3]

        def add_request(self, ids, params):
            self.next_id += 1
            self.live[self.next_id] = 0
            return SimpleNamespace(seq_id=self.next_id, params=params)

        def abort(self, seq_id):
            self.live.pop(seq_id, None)

        def has_work(self):
            return bool(self.live)

        def step(self):
            events = []
            for sid in list(self.live):
                self.live[sid] += 1
                if self.live[sid] >= steps:
                    del self.live[sid]
                    events.append((sid, self.last))
                else:
                    events.append((sid, self.mid))
            return events, None

        def shutdown(self):
            pass

    async def run() -> float:
        engine = AsyncEngine(FakeEngine, "bridge", batch)
        engine.start()
        engine.wait_ready(timeout=30)

        async def one() -> int:
            return len([e async for e in engine.generate("p", SamplingParams(max_new_tokens=steps))])

        try:
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one() for _ in range(batch)))
            wall = time.perf_counter() - t0
        finally:
            engine.stop()
        if counts != [steps] * batch:
            raise RuntimeError(f"the bridge lost events: {counts[:4]}...")
        return wall / steps * 1e3

    return asyncio.run(run())


def _measure_main(args) -> None:
    import tpserve

    here = Path(tpserve.__file__).resolve()
    if not here.is_relative_to(Path(args.tree).resolve()):
        raise SystemExit(f"tpserve imported from {here}, not from {args.tree}: run the tree's "
                         "benchmark with its directory first on sys.path")
    res = {f"{b}/{int(pc)}": measure(b, args.steps, args.prompt_len, pc)
           for b in args.batches for pc in (False, True)}
    for b in args.batches:
        res[f"{b}/1"]["bridge"] = measure_bridge(b, args.steps)
    print(json.dumps(res))


# --- the side-by-side table ---------------------------------------------------------------
def _run_tree(tree: Path, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--measure", "--tree", str(tree),
           "--steps", str(args.steps), "--prompt-len", str(args.prompt_len),
           "--batches", *map(str, args.batches)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:  # say why, not only that it failed
        raise SystemExit(f"measuring {tree} failed (exit {out.returncode}):\n"
                         f"{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _best(a: dict | None, b: dict) -> dict:
    """Each case's and part's minimum over runs (noise on a shared machine only adds)."""
    if a is None:
        return b
    return {k: {p: min(v, a[k][p]) for p, v in parts.items()} for k, parts in b.items()}


def _commit(tree: Path) -> str:
    marker = tree / "COMMIT"
    if marker.exists():
        return marker.read_text().strip()[:12]
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def table(new: dict, old: dict | None, new_name: str, old_name: str | None) -> str:
    head = ["batch", "prefix cache", "part", f"new ms/step ({new_name})"]
    if old is not None:
        head += [f"old ms/step ({old_name})", "old / new"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for key, parts in new.items():
        b, pc = key.split("/")
        for p in (*PARTS, "total", "mean", "bridge"):
            if p not in parts:
                continue
            name = {"total": "**total** (median)", "mean": "total (mean, GC pauses in)"}.get(p, p)
            row = [b, "on" if pc == "1" else "off", name,
                   f"{parts[p]:.3f}"]
            if old is not None:
                o = old[key][p]
                row += [f"{o:.3f}", f"{o / parts[p]:.1f}x" if parts[p] > 1e-4 else "-"]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_doc(path: Path, text: str) -> None:
    """Replace this benchmark's section of the doc (or append it)."""
    title = "### Host cost per decode step (benchmarks/host_step.py)"
    doc = path.read_text() if path.exists() else ""
    start = doc.find(title)
    if start < 0:  # first run: after the other CPU sections, else at the end
        at = doc.find("\n## Reference figures")
        if at < 0:
            path.write_text(doc.rstrip("\n") + "\n\n" + text + "\n")
        else:
            path.write_text(doc[:at].rstrip("\n") + "\n\n" + text + "\n" + doc[at:])
        return
    end = doc.find("\n## ", start + len(title))
    end2 = doc.find("\n### ", start + len(title))
    end = min(e for e in (end, end2, len(doc)) if e >= 0)
    path.write_text(doc[:start] + text + "\n" + doc[end:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, help="another tree to measure side by side")
    ap.add_argument("--steps", type=int, default=48, help="timed decode steps per case")
    ap.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request")
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--repeat", type=int, default=2,
                    help="runs per tree, alternating; the table keeps each value's best")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md",
                    help="markdown file whose host-step section is replaced ('-': none)")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--tree", default=str(ROOT), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        _measure_main(args)
        return
    new, old = None, None
    for _ in range(args.repeat):  # alternate the trees; keep each value's best run
        new = _best(new, _run_tree(ROOT, args))
        if args.old:
            old = _best(old, _run_tree(args.old.resolve(), args))
    new_name, old_name = _commit(ROOT), _commit(args.old) if args.old else None
    tab = table(new, old, new_name, old_name)
    print(tab)
    if str(args.out) == "-":
        return
    cpu = _cpu_name()
    text = (f"### Host cost per decode step (benchmarks/host_step.py)\n\n"
            f"{datetime.date.today().isoformat()}; {cpu}, {os.cpu_count()} cores "
            f"(shared with other jobs), Python {platform.python_version()}. Median ms per "
            f"decode step over {args.steps} steps (best of {args.repeat} alternating runs), "
            f"{args.prompt_len}-token prompts, a fake executor that answers at once "
            f"(`python benchmarks/host_step.py --old TREE`). Parts:\n\n"
            + "\n".join(f"- {k}: {v}" for k, v in PART_DOC.items()) + "\n\n" + tab
            + "\n\n" + READING)
    write_doc(args.out, text)


if __name__ == "__main__":
    main()
