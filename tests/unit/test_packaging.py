"""Packaging: every code folder is installed, and the CLI's import chain does not pull in Triton."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CODE_FOLDERS = {
    "node": "wanswarm.node",
    "transport": "wanswarm.transport",
    "kernels": "wanswarm.kernels",
}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed_in_pyproject() -> None:
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    package_dir = setuptools["package-dir"]
    missing = []
    for folder, name in CODE_FOLDERS.items():
        assert package_dir.get(name) == folder, f"package-dir must map {name} to {folder}/"
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            relative = init.parent.relative_to(ROOT / folder)
            dotted = ".".join([name, *relative.parts])
            if dotted not in listed:
                missing.append(dotted)
    assert not missing, (
        f"add these packages to [tool.setuptools] packages in pyproject.toml: {missing}"
    )


def test_console_script_points_at_the_cli() -> None:
    assert _pyproject()["project"]["scripts"]["wanswarm"] == "wanswarm.node.cli:main"


def test_importing_the_daemon_does_not_import_triton() -> None:
    code = (
        "import sys, wanswarm.node, wanswarm.node.cli, wanswarm.node.daemon\n"
        "print('triton' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", "wanswarm.node.daemon imported triton"


def test_status_path_does_not_import_hivemind_or_torch(tmp_path: Path) -> None:
    """'wanswarm status' and 'leave' must start fast: no hivemind, no torch on their path.
    The image's health check runs 'wanswarm status' every 10 s; with torch on its path each
    run cost about 2 s of CPU."""
    code = (
        "import sys, wanswarm.node.cli as cli\n"
        "for command in ('status', 'leave'):\n"
        "    args = [command, '--state-dir', sys.argv[1]]\n"
        "    try:\n"
        "        cli.main(args)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(sorted(m for m in ('hivemind', 'torch', 'triton') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "none")],
        capture_output=True, text=True, timeout=60,
    )
    assert "no daemon is running" in result.stderr, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"
