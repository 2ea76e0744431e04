"""CI runs README command 2 verbatim: keep the two in step."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme[:12] if line.startswith("python3 -m venv")]
    assert len(commands) == 2, "the README must start with the two set-up commands"
    assert "tpserve launch" in commands[0] and "pytest" in commands[1]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
