"""The docs stand alone: every file and section they point to is in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) links in Markdown; external ones (scheme:) are not checked here.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in md.read_text().splitlines()
            if line.startswith("#")}


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.name)
def test_no_reference_outside_the_repository(md):
    text = md.read_text()
    assert "../shared" not in text
    # The team's notes that once lived next to the repository, by name.
    for name in ("anchors.md", "design.md", "device/README.md"):
        assert name not in text, f"{md.name} points to {name}, which users do not have"


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(md):
    broken = []
    for target in LINK.findall(md.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{md.name}: links to nothing: {broken}"


def test_backticked_repository_paths_exist():
    """`docs/x.md`, `benchmarks/x.py`, `configs/`... quoted in the docs are in the tree."""
    prefixes = ("docs/", "benchmarks/", "configs/", "scripts/", "tests/", "tpserve/")
    missing = []
    for md in DOCS:
        for quoted in re.findall(r"`([^`\s]+)`", md.read_text()):
            path = quoted.rstrip("/")
            if quoted.startswith(prefixes) and not any(c in path for c in "*<>{}") \
                    and not (ROOT / path).exists():
                missing.append(f"{md.name}: {quoted}")
    assert not missing, missing


def test_readme_links_the_gpu_quickstart_and_troubleshooting():
    readme = (ROOT / "README.md").read_text()
    assert "(docs/quickstart-gpu.md)" in readme and "(docs/troubleshooting.md)" in readme
    gpu = (ROOT / "docs" / "quickstart-gpu.md").read_text()
    # The matching PyTorch build comes before tpserve in both install paths.
    for index in ("download.pytorch.org/whl/cu", "download.pytorch.org/whl/xpu"):
        assert gpu.index(index) < gpu.index("pip install -e .", gpu.index(index))


def test_troubleshooting_covers_what_new_users_hit():
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    for needle in ("~/.ray/auth_token", "RAY_AUTH_MODE", "HF_HUB_OFFLINE", "Out of memory",
                   "A shard that will not place", "hf download"):
        assert needle in text, needle


def test_hints_name_commands_and_flags_that_exist():
    """Error hints: `hf` (huggingface_hub's current CLI), and only flags tpserve has."""
    from tpserve.cli import build_parser

    parser = build_parser()
    flags = {o for a in parser._actions for o in a.option_strings}  # noqa: SLF001
    for sub in parser._subparsers._group_actions[0].choices.values():  # noqa: SLF001
        flags |= {o for a in sub._actions for o in a.option_strings}  # noqa: SLF001
    assert "--trust-remote-code" not in flags  # so no message may suggest it
    for path in sorted((ROOT / "tpserve").rglob("*.py")):
        text = path.read_text()
        assert "huggingface-cli download" not in text, path
        assert "trust_remote_code=True" not in text, path
        text = text.replace("no --trust-remote-code", "")  # the refusal names it, as absent
        text = re.sub(r"`ray start[^`]*`", "", text)  # Ray's own CLI flags
        text = re.sub(r"`hf download[^`]*`", "", text)  # huggingface_hub's (--local-dir)
        unknown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", text)) - flags
        assert not unknown, f"{path.relative_to(ROOT)} names flags tpserve lacks: {unknown}"


# --- the examples run ------------------------------------------------------------------------
# The address the docs use, whichever way they spell it.
DOC_URL = re.compile(r"(?:http://)?(?:localhost|127\.0\.0\.1):8080")


def _fenced(lang: str) -> list[tuple[str, str]]:
    """(doc:block number, code) of each ```lang block that talks to a server on :8080."""
    found = []
    for md in DOCS:
        blocks = re.findall(rf"```{lang}\n(.*?)```", md.read_text(), re.DOTALL)
        found += [(f"{md.name}:{i}", code) for i, code in enumerate(blocks)
                  if DOC_URL.search(code)]
    return found


def _curl_commands() -> list[tuple[str, str]]:
    """Every curl command line of the docs against :8080: the README's inline one and those
    of ```bash blocks (continuation lines joined)."""
    commands = [(f"README.md:inline{i}", c) for i, c in enumerate(
        re.findall(r"`(curl [^`]*)`", (ROOT / "README.md").read_text())) if DOC_URL.search(c)]
    for where, block in _fenced("bash"):
        lines = block.replace("\\\n", " ").splitlines()
        commands += [(f"{where}:{i}", line.split("  #")[0]) for i, line in enumerate(lines)
                     if line.startswith("curl ") and DOC_URL.search(line)]
    return commands


def test_the_examples_are_found():
    """The collection below is not empty by accident (a changed fence or address)."""
    assert len(_fenced("python")) >= 2 and len(_curl_commands()) >= 5


@pytest.mark.parametrize("where,code", _fenced("python"), ids=[w for w, _ in _fenced("python")])
def test_python_examples_run_against_a_server(server, backend, where, code, capsys):
    """Each Python example, pointed at a server (the HTTP app over a fake engine), runs as
    written, including its `async def main()` when it defines one."""
    import asyncio

    url = server[1]
    namespace: dict = {"__name__": "__doc_example__"}
    exec(compile(DOC_URL.sub(url, code), where, "exec"), namespace)  # noqa: S102
    if asyncio.iscoroutinefunction(namespace.get("main")):
        asyncio.run(namespace["main"]())
    assert "Traceback" not in capsys.readouterr().out


def test_the_readme_python_one_liner_runs_against_a_server(server, backend):
    (line,) = re.findall(r"`(tpserve\.Client\([^`]*)`", (ROOT / "README.md").read_text())
    import tpserve

    text = eval(DOC_URL.sub(server[1], line), {"tpserve": tpserve})  # noqa: S307
    assert isinstance(text, str) and text


@pytest.mark.parametrize("where,command", _curl_commands(),
                         ids=[w for w, _ in _curl_commands()])
def test_curl_examples_get_an_answer(server, backend, where, command):
    import shutil
    import subprocess

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    host = server[1].removeprefix("http://")
    out = subprocess.run(["bash", "-c", DOC_URL.sub(host, command) + " --fail-with-body"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, f"{where}: {command}\n{out.stdout}{out.stderr}"
    assert out.stdout.strip() and '"error"' not in out.stdout, out.stdout
