"""examples/prefill_decode.py (and benchmarks/directory.py, whose --nodes 0 was a
ZeroDivisionError) as a new user runs it with arguments that cannot work: one
``error:`` line and status 2 before any process starts. Each of these failed in a child
process and the driver printed a RuntimeError traceback ("the prefill process exited before
serving", status 1); ``decode`` as the role printed an InvalidTypeError traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "prefill_decode.py"


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--prompt", "0"], "--prompt"),
        (["--prompt", "15"], "--prompt"),  # no full page: nothing reused, "MISMATCH"
        (["--generate", "0"], "--generate"),  # ran, "match" over no token
        (["--shared", "redis", "--redis-ttl", "-1"], "ttl"),
        (["--shared", "redis", "--redis-ttl", "nan"], "ttl"),
        (["--shared", "redis", "--redis-url", "http://x"], "--redis-url"),
        (["--redis-cluster"], "--redis-cluster"),  # ignored without --shared redis
        (["decode"], "role"),
        (["prefill"], "role"),  # (no secret in the environment: a child's traceback)
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_prefill_decode_refuses_what_cannot_run(
    args: list[str], flag: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TIERKV_TRANSPORT_SECRET", raising=False)
    got = subprocess.run(
        [sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 2, got.stderr
    last = got.stderr.strip().splitlines()[-1]
    assert "error:" in last and flag in last and "Traceback" not in got.stderr, got.stderr


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--nodes", "0"], "--nodes"),  # ZeroDivisionError
        (["--ttl", "0"], "--ttl"),  # DirectoryURLError traceback, redis-server started first
        (["--ttl", "nan"], "--ttl"),
        (["--keys", "3", "--nodes", "4"], "--keys"),
        (["--workers", "0"], "--workers"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_the_directory_benchmark_refuses_sizes_that_cannot_run(args: list[str], flag: str) -> None:
    script = EXAMPLE.parents[1] / "benchmarks" / "directory.py"
    got = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 2, got.stderr
    last = got.stderr.strip().splitlines()[-1]
    assert "error:" in last and flag in last and "Traceback" not in got.stderr, got.stderr
