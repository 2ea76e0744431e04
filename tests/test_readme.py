"""CI runs README command 2 verbatim: keep the two in step."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme[:12] if line.startswith("python3 -m venv")]
    assert len(commands) == 2, "the README must start with the two set-up commands"
    assert "tpserve launch" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()


def _stat(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command (state, ppid, pgrp, session...); None once
    the process is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def _session_processes(sid: int) -> list[int]:
    """Live processes of session `sid` (the launcher's: it leads its own, as a shell's job)."""
    pids = [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]
    return [p for p in pids if (f := _stat(p)) is not None and int(f[3]) == sid]


@pytest.mark.slow
def test_readme_command_1_then_its_curl_and_python_lines_then_ctrl_c(tmp_path):
    """`tpserve launch --tp 2` on the embedded model; the README's curl line and Python
    one-liner, as written but for the port, answer with text; Ctrl-C (SIGINT to the
    launcher's process group, as a terminal sends it) stops it with status 0, leaves no
    Ray or worker process behind, and its last line says so."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from server_process import launched_process
    from test_rebuild_server import descendants

    readme = (ROOT / "README.md").read_text()
    (launch,) = [line for line in readme.splitlines()[:12] if line.startswith("python3 -m venv")
                 and "tpserve launch" in line]
    argv = launch.split("&& tpserve launch", 1)[1].split()
    assert argv == ["--tp", "2"], "the README's launch command changed: update this test"
    (curl,) = re.findall(r"`(curl [^`]*localhost:8080[^`]*)`", readme)
    (python,) = re.findall(r"`(tpserve\.Client\([^`]*)`", readme)
    with launched_process(argv, tmp_path / "server.log") as (proc, url):
        ours = descendants(proc.pid)
        assert ours, "the launcher started no processes: the check below would prove nothing"
        out = subprocess.run(["bash", "-c", curl.replace("localhost:8080", url[7:])],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        text = json.loads(out.stdout)["generated_text"]
        assert len(text.split()) >= 5, text  # 30 tokens of English-like text
        code = f"import tpserve; print(repr({python.replace('http://127.0.0.1:8080', url)}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        assert len(out.stdout.split()) >= 5, out.stdout
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0, (tmp_path / "server.log").read_text()[-3000:]
    deadline = time.monotonic() + 20  # workers exit right after the raylet that owns them
    while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {left}"
    assert not [p for p in ours if _stat(p) is not None], "launcher's children left behind"
    last = (tmp_path / "server.log").read_text().splitlines()[-1]
    assert last == "tpserve: stopped (the local Ray cluster it started has exited)", last
