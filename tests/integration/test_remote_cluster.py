"""Page servers in a cluster directory (Redis): locate across nodes, loads from whichever node
holds a page, eviction announcements to watchers, nodes and watchers that go away; and a
cluster without a directory (its seeds asked).

Most tests run three servers in this process (each over its own store); the last one runs three
real server processes (this file as a script: ``python test_remote_cluster.py serve URL``).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest

pytest.importorskip("redis")
sys.path.insert(0, str(Path(__file__).parent))
from redis_server import RedisServer, skip_without_redis

from tierkv.keys import page_key, prefix_keys
from tierkv.remote import PageServer, PeerGoneError, RemoteTier
from tierkv.remote.errors import NodeIdTakenError
from tierkv.remote.sources.cluster import RemoteCluster
from tierkv.spec import KVSpec
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SECRET = b"remote-cluster-test"
TIMEOUT = 5.0
TTL = 1.0  # the servers' registration ttl in these tests


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    skip_without_redis()
    with RedisServer() as srv:
        yield srv.url


def page_keys(seed: int, n: int = 4) -> list[bytes]:
    """``n`` content page keys (block-major, 2 layers) of a prompt drawn from ``seed``."""
    toks = [seed * 1000 + i for i in range(n // 2 * 4)]
    return [page_key(b, layer) for b in prefix_keys(toks, 4) for layer in range(2)]


def page_bytes(seed: int, n: int = 4) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.random.default_rng(seed).integers(0, 256, (n, PAGE), np.uint8)


def store_pages(store: KVStore, seed: int, n: int = 4) -> list[bytes]:
    """Put pages of ``seed`` into the store's host tier (as a compute or import would)."""
    arena = store.tiers.glue.host_array
    keys = page_keys(seed, n)
    alloc = store.tiers.glue.reserve_host(keys)
    assert alloc is not None and not alloc.evicted
    arena[alloc.slots] = page_bytes(seed, n)
    store.tiers.glue.commit_host(keys)
    return keys


async def wait_until(get: Callable[[], Any], want: object, what: str, bound: float = 20.0) -> None:
    """Wait (bounded) for ``await get()`` to equal ``want``."""
    deadline = time.monotonic() + bound
    while (got := await get()) != want:
        assert time.monotonic() < deadline, f"not within {bound} s: {what} ({got!r})"
        await asyncio.sleep(0.02)


async def wait_until_true(cond: Callable[[], bool], what: str, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound} s: {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def servers(
    n: int = 3, pages: int = 16, directory: str | None = None, **kw: Any
) -> AsyncIterator[list[PageServer]]:
    """``n`` servers, registered in ``directory`` (a Redis URL) if given."""
    async with contextlib.AsyncExitStack() as stack:
        out: list[PageServer] = []
        for _ in range(n):
            store = KVStore(SPEC, device_bytes=PAGE, host_bytes=pages * PAGE, codec=None)
            await stack.enter_async_context(store)
            srv = PageServer(store, secret=SECRET, directory=directory, directory_ttl=TTL, **kw)
            out.append(await stack.enter_async_context(srv))
        yield out


def published(s: PageServer) -> None:
    """Local additions reach the directory at the agent's next sync: ask for one now."""
    assert s.agent is not None
    s.agent.changed()


def cluster(url: str | None, seeds: list[str] | None = None) -> RemoteCluster:
    return RemoteCluster(seeds, directory=url, secret=SECRET, spec=SPEC, timeout=TIMEOUT)


def client(srv: PageServer | str, timeout: float = TIMEOUT) -> RemoteTier:
    address = srv if isinstance(srv, str) else srv.address
    return RemoteTier(address, transport="tcp", secret=SECRET, spec=SPEC, timeout=timeout)


async def test_single_node_needs_no_setup() -> None:
    async with servers(1) as (a,), client(a) as c:
        keys = store_pages(a.store, 1)
        assert await c.locate(keys + page_keys(2)) == [a.address] * 4
        assert "directory_registered" not in await c.stats()


async def test_locate_and_load_across_three_servers(redis_url: str) -> None:
    async with servers(3, directory=redis_url) as (a, b, c):
        keys = [k for i, s in enumerate((a, b, c)) for k in store_pages(s.store, i)]
        for s in (a, b, c):
            published(s)
        want = [a.address] * 4 + [b.address] * 4 + [c.address] * 4
        local = np.zeros((16, PAGE), np.uint8)
        async with cluster(redis_url) as rc:  # no seed: the directory alone
            await wait_until(lambda: rc.locate(keys + page_keys(9)), want, "every page located")
            assert await rc.lookup(keys) == 12
            assert await rc.load(keys, local, list(range(2, 14))) == 12
            assert rc.loads_from == {a.address: 4, b.address: 4, c.address: 4}
        for i in range(3):
            assert (local[2 + 4 * i : 6 + 4 * i] == page_bytes(i)).all()


async def test_a_cluster_without_directory_asks_its_seeds() -> None:
    async with servers(3) as (a, b, c):
        keys = [k for i, s in enumerate((a, b, c)) for k in store_pages(s.store, i)]
        async with cluster(None, [a.address, b.address, c.address]) as rc:
            assert await rc.locate(keys + page_keys(9)) == [
                *[a.address] * 4,
                *[b.address] * 4,
                *[c.address] * 4,
            ]
        async with cluster(None, [b.address]) as rc:  # only b's pages: the run stops at a's
            assert await rc.locate(keys[4:8] + keys[:4]) == [b.address] * 4


async def test_a_cluster_without_directory_raises_only_when_no_seed_answers() -> None:
    """A dead seed among live ones is skipped; when no seed answers, the error is raised (the
    store counts it), as a single unreachable page server's is."""
    with contextlib.closing(__import__("socket").socket()) as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens there
    async with servers(1) as (a,):
        keys = store_pages(a.store, 1)
        async with cluster(None, [dead, a.address]) as rc:
            assert await rc.locate(keys) == [a.address] * 4
        async with cluster(None, [dead]) as rc:
            with pytest.raises(PeerGoneError):
                await rc.locate(keys)


async def test_eviction_is_announced_and_leaves_the_directory(redis_url: str) -> None:
    async with (
        servers(2, pages=4, directory=redis_url) as (_a, b),
        client(b) as cb,
        cluster(redis_url) as rc,
    ):
        watched = store_pages(b.store, 1)
        published(b)
        await wait_until(lambda: rc.locate(watched), [b.address] * 4, "b's pages located")
        watch = await cb.watch(watched + page_keys(7))  # page_keys(7): not held
        try:
            assert watch.keys == set(watched)
            # a peer publishes 4 other pages: b's host tier evicts the watched ones
            fresh = page_keys(2)
            assert await cb.publish(fresh, page_bytes(2), [0, 1, 2, 3]) == 4
            gone = await asyncio.wait_for(anext(watch), TIMEOUT)
            while set(gone) != set(watched):
                gone += await asyncio.wait_for(anext(watch), TIMEOUT)
            assert sorted(gone) == sorted(watched) and not watch.keys
            assert (await cb.stats())["announced"] == 4
        finally:
            await watch.aclose()
        await wait_until(lambda: rc.locate(watched), [], "the departed pages left")
        await wait_until(lambda: rc.locate(fresh), [b.address] * 4, "the new pages known")
        with pytest.raises(StopAsyncIteration):
            await anext(watch)


async def test_announcements_by_callback_and_unwatch() -> None:
    async with servers(1, pages=4) as (a,), client(a) as c:
        keys = store_pages(a.store, 1)
        got: list[bytes] = []
        watch = await c.watch(keys, callback=got.extend)
        try:
            await watch.remove(keys[:2])
            assert watch.keys == set(keys[2:])
            await c.publish(page_keys(2), page_bytes(2), [0, 1, 2, 3])
            await wait_until_true(lambda: len(got) == 2, "two announcements")
            assert sorted(got) == sorted(keys[2:])
        finally:
            await watch.aclose()


async def test_slow_watcher_is_dropped_not_the_server() -> None:
    async with servers(1, pages=4, watch_pending=2) as (a,), client(a) as c:
        keys = store_pages(a.store, 1)
        watch = await c.watch(keys)
        other = await c.watch(keys[:1])
        try:
            await c.publish(page_keys(2), page_bytes(2), [0, 1, 2, 3])  # 4 > 2 queued: dropped
            with pytest.raises(PeerGoneError, match="closed by the server"):
                while True:
                    await asyncio.wait_for(anext(watch), TIMEOUT)
            assert await asyncio.wait_for(anext(other), TIMEOUT) == keys[:1]
            s = await c.stats()
            assert s["watchers_dropped"] == 1
            assert await c.lookup(page_keys(2)) == 4  # the server serves on
        finally:
            await watch.aclose()
            await other.aclose()


async def test_watcher_and_node_disconnects(redis_url: str) -> None:
    async with servers(3, directory=redis_url) as (a, b, c), cluster(redis_url) as rc:
        keys = store_pages(b.store, 1)
        published(b)
        await wait_until(lambda: rc.locate(keys), [b.address] * 4, "b's pages located")
        watch = await client(b).watch(keys)
        await wait_until_true(lambda: b.watches.watchers == 1, "b has the watcher")
        await watch.aclose()
        await wait_until_true(lambda: b.watches.watchers == 0, "b forgot the watcher")
        b.store.tiers.cold.forget_in("host", keys)  # a departure with nobody watching
        published(b)
        await wait_until(lambda: rc.locate(keys), [], "b's departed pages left the directory")
        keys = store_pages(c.store, 3)
        published(c)
        await wait_until(lambda: rc.locate(keys), [c.address] * 4, "c's pages located")
        await c.aclose()  # a node that stops leaves the directory at once
        assert await rc.locate(keys) == []
        async with client(a) as ca:
            s = await ca.stats()
            assert s["directory_registered"] == 1 and s["directory_errors_total"] == 0


async def test_a_second_server_on_a_registered_address_is_refused(redis_url: str) -> None:
    async with servers(1, directory=redis_url) as (a,):
        store = KVStore(SPEC, device_bytes=PAGE, host_bytes=4 * PAGE, codec=None)
        async with store:
            twin = PageServer(
                store, secret=SECRET, directory=redis_url, directory_ttl=TTL, advertise=a.address
            )
            with pytest.raises(NodeIdTakenError, match=a.address):
                await twin.start()
            assert twin.control.sessions == 0  # closed again


async def test_directory_down_answers_not_known(redis_url: str) -> None:
    dead = RemoteCluster(
        directory="redis://127.0.0.1:1/0", secret=SECRET, spec=SPEC, timeout=TIMEOUT
    )
    async with dead:
        assert await dead.locate(page_keys(1)) == []  # not known: a miss, no exception
        assert await dead.lookup(page_keys(1)) == 0
        assert dead.directory_errors == 2


# -- three real processes ------------------------------------------------------------------
async def _serve() -> None:
    """The server process: waits for ``directory URL`` on stdin, then serves."""
    loop = asyncio.get_running_loop()
    line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=16 * PAGE, codec=None)
    srv = PageServer(store, secret=SECRET, directory=line[1], directory_ttl=TTL)
    async with store, srv:
        print("READY", srv.address, flush=True)
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                return
            if line[0] == "fill":
                store_pages(store, int(line[1]))
                assert srv.agent is not None
                srv.agent.changed()
                print("FILLED", flush=True)


class Proc:
    """One page server process, driven over stdin/stdout."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.address = ""

    def expect(self, word: str) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == word, f"server said {line!r}, expected {word}"
        return line[1:]

    def start(self, directory: str) -> Proc:
        (self.address,) = self.command(f"directory {directory}", "READY")
        return self

    def command(self, cmd: str, answer: str) -> list[str]:
        stdin: IO[str] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(cmd + "\n")
        stdin.flush()
        return self.expect(answer)

    def quit(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()

    def stop(self) -> None:
        self.quit()
        if self.proc.poll() is None:
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def procs(redis_url: str) -> Iterator[list[Proc]]:
    """Three server processes registered in the module's Redis."""
    started = [Proc() for _ in range(3)]  # together: each costs seconds of imports
    try:
        for p in started:
            p.start(redis_url)
        yield started
    finally:
        for p in started:
            p.quit()  # all at once: each takes seconds to exit
        for p in started:
            p.stop()


def test_three_processes_share_a_directory(procs: list[Proc], redis_url: str) -> None:
    asyncio.run(_three_processes(procs, redis_url))


async def _three_processes(procs: list[Proc], url: str) -> None:
    addrs = [p.address for p in procs]
    keys = []
    for i, p in enumerate(procs):
        p.command(f"fill {i}", "FILLED")
        keys += page_keys(i)
    want = [a for a in addrs for _ in range(4)]
    local = np.zeros((12, PAGE), np.uint8)
    async with cluster(url) as rc:
        await wait_until(lambda: rc.locate(keys), want, "every page located")
        assert await rc.load(keys, local, list(range(12))) == 12
        assert rc.loads_from == dict.fromkeys(addrs, 4)
        for i in range(3):
            assert (local[4 * i : 4 * i + 4] == page_bytes(i)).all()
        async with client(addrs[2]) as cc, client(addrs[1]) as cb:
            on_b = await cb.watch(keys[4:8])
            on_c = await cc.watch(keys[8:])
            fresh = page_keys(50, 16)  # fills c's 16 host pages: its own 4 are evicted for them
            assert await cc.publish(fresh, page_bytes(50, 16), list(range(16))) == 16
            gone: list[bytes] = []
            while len(gone) < 4:
                gone += await asyncio.wait_for(anext(on_c), TIMEOUT)
            assert sorted(gone) == sorted(keys[8:])
            await on_c.aclose()
            procs[1].proc.kill()  # b dies: its watcher hears it, it leaves the answers in ttl
            procs[1].proc.wait()
            with pytest.raises(PeerGoneError):
                await asyncio.wait_for(anext(on_b), TIMEOUT)
            await on_b.aclose()
        await wait_until(lambda: rc.locate(keys), [addrs[0]] * 4, "the killed b left")
        await wait_until(lambda: rc.locate(fresh), [addrs[2]] * 16, "c's new pages located")
        assert await rc.locate(keys[8:]) == []


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    asyncio.run(_serve())
