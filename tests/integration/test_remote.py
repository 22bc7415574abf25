"""The page server and RemoteTier across two real processes, over shm and tcp.

The server side is this file run as a script (``python test_remote.py serve``): a store whose
host tier is served by a PageServer, filled on command with deterministic pages. The reader is
the test process. Server processes start together, once per module, because each costs seconds
of imports.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

import numpy as np
import pytest

from tierkv import KVStore, prefix_keys
from tierkv.keys import page_key
from tierkv.remote import (
    PageServer,
    PeerGoneError,
    RemoteError,
    RemoteTier,
    RemoteTimeoutError,
)
from tierkv.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16)
PAGES = 64  # the server's host tier: every fill reuses every slot
SECRET = b"remote-test-secret"
TIMEOUT = 3.0
FROZEN = 0.5  # the bound of the test that freezes, then kills, the server
BACKENDS = ["shm", "tcp"]


def page_keys(seed: int) -> list[bytes]:
    """PAGES content page keys (block-major) of a prompt drawn from ``seed``."""
    toks = np.random.default_rng(seed).integers(0, 1000, PAGES // 2 * 16).tolist()
    return [page_key(b, layer) for b in prefix_keys(toks, 16) for layer in range(2)]


def page_bytes(seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes of every page of fill ``seed``: [PAGES, page_bytes]."""
    return np.random.default_rng(seed + 1).integers(0, 256, (PAGES, SPEC.page_bytes), np.uint8)


# -- the server process ----------------------------------------------------------------------
async def _serve(kind: str) -> None:
    store = KVStore(
        SPEC, device_bytes=SPEC.page_bytes, host_bytes=PAGES * SPEC.page_bytes, codec=None
    )
    async with store, PageServer(store, transports=[kind], secret=SECRET, lease_ttl=30) as srv:
        tiers, table, arena = store.tiers, store.tiers.table, store.tiers.glue.host_array
        handle = srv.shared[kind].region.descriptor.handle or "-"
        print("READY", srv.address, handle, flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                return
            if line[0] == "fill":  # drop every lease and page, then store fill SEED
                seed = int(line[1])
                assert srv.directory is not None
                srv.directory.expire_all()
                tiers.cold.forget_in("host", table.keys("host"))
                keys = page_keys(seed)
                alloc = tiers.glue.reserve_host(keys)
                assert alloc is not None and len(alloc.slots) == PAGES, "host tier not free"
                arena[alloc.slots] = page_bytes(seed)
                tiers.glue.commit_host(keys)
                print("FILLED", seed, flush=True)
            elif line[0] == "check":  # how many pages of fill SEED are held; all bit-exact?
                keys, want = page_keys(int(line[1])), page_bytes(int(line[1]))
                held = [(i, k) for i, k in enumerate(keys) if table.lookup([k], "host")]
                exact = all((arena[table.slot(k, "host")] == want[i]).all() for i, k in held)
                print("CHECK", len(held), int(exact), flush=True)


class Server:
    """One server process, driven over stdin/stdout."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve", kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.address = ""
        self.segment = ""

    @property
    def stdin(self) -> IO[str]:
        assert self.proc.stdin is not None
        return self.proc.stdin

    def expect(self, word: str) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == word, f"server said {line!r}, expected {word}"
        return line[1:]

    def ready(self) -> Server:
        if not self.address:
            self.address, self.segment = self.expect("READY")
        return self

    def command(self, cmd: str, answer: str) -> list[str]:
        self.stdin.write(cmd + "\n")
        self.stdin.flush()
        return self.expect(answer)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stdin.write("quit\n")
                self.stdin.flush()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, list[Server]]]:
    """Per backend: a long-lived server and one to kill (started now, in parallel: each costs
    seconds of imports)."""
    pool = {kind: [Server(kind) for _ in range(2)] for kind in BACKENDS}
    try:
        yield pool
    finally:
        for s in (s for group in pool.values() for s in group):
            s.stop()


@pytest.fixture
def main_server(servers: dict[str, list[Server]], request: pytest.FixtureRequest) -> Server:
    return servers[request.param][0].ready()


@pytest.fixture
def doomed_server(servers: dict[str, list[Server]], request: pytest.FixtureRequest) -> Server:
    return servers[request.param][1].ready()


def _peer(server: Server, timeout: float = TIMEOUT) -> RemoteTier:
    kw: dict[str, Any] = {"secret": SECRET, "spec": SPEC, "timeout": timeout}
    return RemoteTier(server.address, transport=server.kind, **kw)


def _local() -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.full((PAGES * 2, SPEC.page_bytes), 0xA5, np.uint8)


# -- tests ---------------------------------------------------------------------------------
@pytest.mark.parametrize("main_server", BACKENDS, indirect=True)
async def test_load_and_publish_are_bit_exact(main_server: Server) -> None:
    seed = 100
    main_server.command(f"fill {seed}", "FILLED")
    keys, want = page_keys(seed), page_bytes(seed)
    local = _local()
    async with _peer(main_server) as peer:
        assert await peer.lookup(keys) == PAGES
        assert await peer.lookup([*keys[:5], page_keys(seed + 1)[0], *keys[5:]]) == 5
        slots = list(range(PAGES * 2 - 1, PAGES - 1, -1))  # reversed: no run coalesces
        assert await peer.load(keys, local, slots) == PAGES
        assert (local[slots] == want).all()
        assert (local[:PAGES] == 0xA5).all()  # other slots untouched
        # a second batch: consecutive slots (one op per run)
        assert await peer.load(keys[:10], local, list(range(10))) == 10
        assert (local[:10] == want[:10]).all()
        # publish: pages the server holds are skipped, new ones land and read back exactly
        new = page_keys(seed + 7)[:4]
        src = np.random.default_rng(5).integers(0, 256, (4, SPEC.page_bytes), np.uint8)
        local[20:24] = src
        assert await peer.publish([*keys[:2], *new], local, [0, 1, 20, 21, 22, 23]) == 4
        assert await peer.lookup(new) == 4
        local[30:34] = 0
        assert await peer.load(new, local, [30, 31, 32, 33]) == 4
        assert (local[30:34] == src).all()
        stats = await peer.stats()
        assert stats["leases"] == 0
    # the publish evicted 4 of the fill's pages (the tier was full); the rest are intact
    assert main_server.command(f"check {seed}", "CHECK") == [str(PAGES - 4), "1"]


@pytest.mark.parametrize("main_server", BACKENDS, indirect=True)
async def test_page_reused_during_a_read_is_a_miss(main_server: Server) -> None:
    seed = 200
    main_server.command(f"fill {seed}", "FILLED")
    keys = page_keys(seed)
    local = _local()
    async with _peer(main_server) as peer:
        lease = await peer.acquire(keys)
        assert len(lease.slots) == PAGES
        # the server drops the lease (as on expiry) and reuses every slot for other pages
        main_server.command(f"fill {seed + 1}", "FILLED")
        await peer.read(lease, local, list(range(PAGES)))
        assert await peer.release(lease) == 0  # every page: generation changed -> miss
        assert await peer.lookup(keys) == 0
        # a normal lease is still honoured
        keys2 = page_keys(seed + 1)
        lease = await peer.acquire(keys2)
        await peer.read(lease, local, list(range(PAGES)))
        assert await peer.release(lease) == PAGES
        assert (local[:PAGES] == page_bytes(seed + 1)).all()


@pytest.mark.parametrize("doomed_server", BACKENDS, indirect=True)
def test_peer_killed_mid_transfer_is_a_typed_error(doomed_server: Server) -> None:
    """Runs once, on the default loop (not under both flavours): each run kills a server."""
    asyncio.run(_killed_mid_transfer(doomed_server))


async def _killed_mid_transfer(doomed_server: Server) -> None:
    seed = 300
    doomed_server.command(f"fill {seed}", "FILLED")
    keys = page_keys(seed)
    local = _local()
    before = local.copy()
    async with _peer(doomed_server, timeout=FROZEN) as peer:
        assert await peer.lookup(keys) == PAGES
        # frozen: the control reply never comes -> a timeout within the bound
        doomed_server.proc.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeoutError):
            await peer.load(keys, local, list(range(PAGES)))
        assert time.monotonic() - t0 < FROZEN + 1
        doomed_server.proc.send_signal(signal.SIGCONT)
    async with _peer(doomed_server, timeout=FROZEN) as peer:
        lease = await peer.acquire(keys)  # pages pinned; then the server dies
        doomed_server.proc.kill()
        doomed_server.proc.wait()
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as info:
            await peer.read(lease, local, list(range(PAGES, 2 * PAGES)))
            await peer.release(lease)
        # shm sees the owner gone at once; tcp may post on a connection whose loss the loop has
        # not processed yet, and then times out
        assert isinstance(info.value, (PeerGoneError, RemoteTimeoutError))
        assert time.monotonic() - t0 < FROZEN + 1
        with pytest.raises(PeerGoneError):
            await peer.load(keys, local, list(range(PAGES)))
    assert (local[:PAGES] == before[:PAGES]).all()  # a failed load left the pages alone
    _unlink_leftovers(doomed_server)


def _unlink_leftovers(server: Server) -> None:
    """A SIGKILLed shm server leaves its host segment behind."""
    if server.segment != "-":
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{server.segment}")


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    asyncio.run(_serve(sys.argv[2]))
