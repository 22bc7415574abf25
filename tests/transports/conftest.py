"""Fixtures for the transport tests (asyncio / uvloop parametrization: tests/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tierkv.transports import RegionDescriptor

ROOT = Path(__file__).resolve().parents[2]


class PeerProcess:
    """A peer in a child process: its metadata and (when it has one) its region's descriptor."""

    def __init__(
        self, proc: asyncio.subprocess.Process, meta: bytes, desc: RegionDescriptor | None
    ) -> None:
        self.proc = proc
        self.meta = meta
        self._desc = desc

    @property
    def desc(self) -> RegionDescriptor:
        assert self._desc is not None
        return self._desc

    async def ask(self, command: str, timeout: float = 5.0) -> list[str]:
        """Send one command line; the words of the reply line."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        return line.decode().split()


@asynccontextmanager
async def spawn_script(script: str, *args: str) -> AsyncIterator[PeerProcess]:
    """Run tests/transports/`script` with `args` until it prints ``READY <meta> [<desc>]``;
    on exit kill and reap it and unlink its shared-memory segment (if any)."""
    argv = [sys.executable, str(Path(__file__).with_name(script)), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=PIPE, stdout=PIPE, stderr=subprocess.DEVNULL, env=env
    )
    desc: RegionDescriptor | None = None
    try:
        assert proc.stdout is not None
        words = (await asyncio.wait_for(proc.stdout.readline(), 10.0)).decode().split()
        assert words and words[0] == "READY", f"{script} failed to start: {words}"
        if len(words) > 2:
            desc = RegionDescriptor.unpack(bytes.fromhex(words[2]))
        yield PeerProcess(proc, bytes.fromhex(words[1]), desc)
    finally:
        if proc.returncode is None:
            proc.kill()
        await asyncio.wait_for(proc.wait(), 10.0)
        if desc is not None and desc.handle:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{desc.handle}")


def spawn_peer(
    backend: str, size: int, seed: int, secret: bytes | None = None
) -> contextlib.AbstractAsyncContextManager[PeerProcess]:
    """A peer_proc.py peer (see there) with one region of `size` seeded bytes."""
    args = [backend, str(size), str(seed)] + ([secret.hex()] if secret is not None else [])
    return spawn_script("peer_proc.py", *args)


@pytest.fixture
def peer_process() -> Callable[..., Any]:
    """`spawn_peer`, as a fixture."""
    return spawn_peer


@pytest.fixture
def script_process() -> Callable[..., Any]:
    """`spawn_script`, as a fixture."""
    return spawn_script
