"""Three real processes per backend: one target serving a region (peer_proc.py), two workers
reading and writing it concurrently (rw_worker.py), all bit-exact; a worker killed mid-transfer
leaves the target serving the other; a target killed mid-transfer fails both workers with a
typed error (bounded by their transport timeout)."""

from __future__ import annotations

import asyncio
import importlib.util
import random
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from .conftest import PeerProcess

SECRET = b"three"
SIZE = 4 << 20
SEED = 21
WAIT_S = 60.0  # generous: the machine may be loaded; never reached when things work

_spec = importlib.util.spec_from_file_location(
    "rw_worker", Path(__file__).with_name("rw_worker.py")
)
assert _spec is not None and _spec.loader is not None
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

pytestmark = [
    pytest.mark.parametrize("backend", ["shm", "tcp"]),
    # the test process only drives pipes; the workers mix asyncio and uvloop themselves
    pytest.mark.asyncio(loop_factories=["asyncio"]),
]


@asynccontextmanager
async def cluster(
    backend: str, peer_process: Callable[..., Any], script_process: Callable[..., Any]
) -> AsyncIterator[tuple[PeerProcess, PeerProcess, PeerProcess]]:
    """A target and two workers (lanes 0 and 1) on `backend`."""
    secret = SECRET if backend == "tcp" else None
    async with AsyncExitStack() as stack:
        target = await stack.enter_async_context(peer_process(backend, SIZE, SEED, secret))
        args = [backend, target.meta.hex(), target.desc.pack().hex(), str(SEED)]
        extra = [secret.hex()] if secret is not None else []
        a, b = await asyncio.gather(
            stack.enter_async_context(script_process("rw_worker.py", *args, "0", *extra)),
            stack.enter_async_context(script_process("rw_worker.py", *args, "1", *extra)),
        )
        yield target, a, b


def expected_region(last_round: dict[int, int]) -> bytes:
    """The target's region after lane `k` last wrote round `last_round[k]`."""
    region = bytearray(random.Random(SEED).randbytes(SIZE))
    for lane, r in last_round.items():
        off, n = worker.lane_span(SIZE, lane)
        region[off : off + n] = worker.lane_bytes(SEED, lane, r, n)
    return bytes(region)


async def next_line(p: PeerProcess) -> list[str]:
    assert p.proc.stdout is not None
    return (await asyncio.wait_for(p.proc.stdout.readline(), WAIT_S)).decode().split()


async def test_two_workers_share_a_target(
    backend: str, peer_process: Any, script_process: Any
) -> None:
    async with cluster(backend, peer_process, script_process) as (target, a, b):
        replies = await asyncio.gather(a.ask("rounds 4", WAIT_S), b.ask("rounds 4", WAIT_S))
        assert [r[0] for r in replies] == ["OK", "OK"], replies
        crc = zlib.crc32(expected_region({0: 3, 1: 3}))
        assert await target.ask("crc", WAIT_S) == ["CRC", str(crc)]


async def test_killed_worker_leaves_the_target_serving_the_other(
    backend: str, peer_process: Any, script_process: Any
) -> None:
    async with cluster(backend, peer_process, script_process) as (target, a, b):
        assert await a.ask("spin", WAIT_S) == ["SPINNING"]  # a is now mid-read, batch after batch
        other = asyncio.ensure_future(b.ask("rounds 4", WAIT_S))
        a.proc.kill()
        await asyncio.wait_for(a.proc.wait(), WAIT_S)
        assert (await other)[0] == "OK"
        assert (await b.ask("rounds 2", WAIT_S))[0] == "OK"
        crc = zlib.crc32(expected_region({1: 1}))
        assert await target.ask("crc", WAIT_S) == ["CRC", str(crc)]


async def test_target_killed_mid_transfer_fails_both_workers(
    backend: str, peer_process: Any, script_process: Any
) -> None:
    async with cluster(backend, peer_process, script_process) as (target, a, b):
        spinning = await asyncio.gather(a.ask("spin", WAIT_S), b.ask("spin", WAIT_S))
        assert spinning == [["SPINNING"], ["SPINNING"]]
        target.proc.kill()
        await asyncio.wait_for(target.proc.wait(), WAIT_S)
        # each worker's failing read ends with a typed error, by its own 5 s deadline at worst
        for words in await asyncio.gather(next_line(a), next_line(b)):
            assert words[0] == "ERR" and words[1] in ("PeerError", "TransferTimeoutError"), words
