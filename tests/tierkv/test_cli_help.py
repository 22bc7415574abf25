"""A new user's first commands: ``python -m tierkv --help`` (it was "No module named
tierkv.__main__") and each subcommand's ``--help`` print without a traceback, and every flag
says what it does (nine of the demo's and four of the planner's had no help text); the example
scripts answer ``--help`` with their usage instead of running (custom_transport.py ran)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["demo", "plan", "replay", "serve"]


def run(*args: str) -> str:
    got = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert got.returncode == 0, got.stderr
    assert "Traceback" not in got.stdout + got.stderr
    return got.stdout


def undocumented(text: str) -> list[str]:
    """The flags of an argparse ``--help`` that have no help text."""
    lines = text.split("options:", 1)[1].splitlines()
    bare = []
    for i, line in enumerate(lines):
        m = re.match(r"  (-\S.*)", line)
        if m is None:
            continue
        same = re.search(r"\S\s{2,}\S", m.group(1))
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if not same and not re.match(r"\s{10,}\S", nxt):
            bare.append(m.group(1))
    return bare


def test_python_dash_m_tierkv_is_the_command() -> None:
    out = run("-m", "tierkv", "--help")
    assert all(c in out for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_documents_every_flag(command: str) -> None:
    out = run("-m", "tierkv", command, "--help")
    assert out.startswith(f"usage: tierkv {command}")
    assert undocumented(out) == []


@pytest.mark.parametrize(
    "script", ["custom_transport.py", "load.py", "prefill_decode.py", "server.py"]
)
def test_the_examples_answer_help_with_their_usage(script: str) -> None:
    out = run(str(ROOT / "examples" / script), "--help")
    assert out.startswith("usage:")
    assert undocumented(out) == []  # (server.py: four flags had none)
