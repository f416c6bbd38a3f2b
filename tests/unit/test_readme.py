"""The README keeps exactly two set-up commands at its top, and CI runs the test one."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block is not None, "README must start with a bash block of set-up commands"
    assert text.index("```bash") < text.index("\n## "), "set-up block must precede sections"
    return [line for line in block.group(1).splitlines() if line.strip()]


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = _readme_commands()
    assert len(commands) == 2
    assert "wanswarm demo" in commands[0]
    assert "pytest" in commands[1]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = ci_lines.index("# README-TEST-COMMAND")
    assert ci_lines[marker + 1] == _readme_commands()[1]
