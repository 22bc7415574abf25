"""Page servers sharing a directory: locate across nodes, loads from whichever node holds a
page, eviction announcements to watchers, peers and watchers that go away.

Most tests run three servers in this process (each over its own store); the last one runs three
real server processes (this file as a script: ``python test_remote_cluster.py serve [SEED]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import IO, Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.keys import page_key, prefix_keys
from tierkv.remote import PageServer, PeerGoneError, RemoteTier
from tierkv.remote.server.gossip import PeerIndex
from tierkv.remote.sources.cluster import RemoteCluster
from tierkv.spec import KVSpec
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SECRET = b"remote-cluster-test"
TIMEOUT = 5.0
SYNC = 0.1  # the servers' directory interval in these tests


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


async def wait_until(cond: Callable[[], Any], what: str, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not await cond() if asyncio.iscoroutinefunction(cond) else not cond():
        assert time.monotonic() < deadline, f"not within {bound} s: {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def servers(n: int = 3, pages: int = 16, **kw: Any) -> AsyncIterator[list[PageServer]]:
    """``n`` servers: the first alone, the others seeded with the first one's address."""
    async with contextlib.AsyncExitStack() as stack:
        out: list[PageServer] = []
        for _ in range(n):
            store = KVStore(SPEC, device_bytes=PAGE, host_bytes=pages * PAGE, codec=None)
            await stack.enter_async_context(store)
            seeds = [out[0].address] if out else []
            srv = PageServer(store, secret=SECRET, peers=seeds, sync_interval=SYNC, **kw)
            out.append(await stack.enter_async_context(srv))
        yield out


def client(srv: PageServer | str, timeout: float = TIMEOUT) -> RemoteTier:
    address = srv if isinstance(srv, str) else srv.address
    return RemoteTier(address, transport="tcp", secret=SECRET, spec=SPEC, timeout=timeout)


async def test_single_node_needs_no_setup() -> None:
    async with servers(1) as (a,), client(a) as c:
        keys = store_pages(a.store, 1)
        assert await c.locate(keys + page_keys(2)) == [a.address] * 4
        assert (await c.stats())["peers"] == []


async def test_locate_and_load_across_three_servers() -> None:
    async with servers(3) as (a, b, c):
        keys = [k for i, s in enumerate((a, b, c)) for k in store_pages(s.store, i)]
        want = [a.address] * 4 + [b.address] * 4 + [c.address] * 4
        for s in (a, b, c):  # every node answers for all (c learned b through a)
            await wait_until(lambda s=s: s.locate(keys) == want, f"{s.address} knows all")
        async with client(c) as cc:
            assert await cc.locate(keys + page_keys(9)) == want
        local = np.zeros((16, PAGE), np.uint8)
        async with RemoteCluster(c.address, secret=SECRET, spec=SPEC, timeout=TIMEOUT) as rc:
            assert await rc.lookup(keys) == 12
            assert await rc.load(keys, local, list(range(2, 14))) == 12
            assert rc.loads_from == {a.address: 4, b.address: 4, c.address: 4}
        for i in range(3):
            assert (local[2 + 4 * i : 6 + 4 * i] == page_bytes(i)).all()


async def test_eviction_is_announced_and_leaves_every_directory() -> None:
    async with servers(3, pages=4) as (a, b, _c), client(b) as cb:
        watched = store_pages(b.store, 1)
        await wait_until(lambda: a.locate(watched) == [b.address] * 4, "a knows b's pages")
        watch = await cb.watch(watched + page_keys(7))  # page_keys(7): not held, not watched
        try:
            assert watch.keys == set(watched)
            # a peer publishes 4 other pages: b's host tier evicts the watched ones for them
            fresh = page_keys(2)
            assert await cb.publish(fresh, page_bytes(2), [0, 1, 2, 3]) == 4
            gone = await asyncio.wait_for(anext(watch), TIMEOUT)
            while set(gone) != set(watched):
                gone += await asyncio.wait_for(anext(watch), TIMEOUT)
            assert sorted(gone) == sorted(watched) and not watch.keys
            assert (await cb.stats())["announced"] == 4
        finally:
            await watch.aclose()
        await wait_until(lambda: a.locate(watched) == [], "a dropped the departed pages")
        await wait_until(lambda: a.locate(fresh) == [b.address] * 4, "a knows the new pages")
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
            await wait_until(lambda: len(got) == 2, "two announcements")
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


async def test_watcher_and_peer_disconnects() -> None:
    async with servers(3) as (a, b, c), client(a) as ca:
        keys = store_pages(b.store, 1)
        await wait_until(lambda: a.locate(keys) == [b.address] * 4, "a knows b's pages")
        watch = await client(b).watch(keys)
        await wait_until(lambda: b.watches.watchers == 1, "b has the watcher")
        await watch.aclose()
        await wait_until(lambda: b.watches.watchers == 0, "b forgot the watcher")
        b.store.tiers.cold.forget_in("host", keys)  # a departure with nobody watching
        await wait_until(lambda: a.locate(keys) == [], "a dropped b's departed pages")
        keys = store_pages(c.store, 3)
        await wait_until(lambda: a.locate(keys) == [c.address] * 4, "a knows c's pages")
        await c.aclose()  # a node goes away: its pages leave every directory
        await wait_until(lambda: a.locate(keys) == [], "a forgot c")
        assert (await ca.stats())["peer_pages"] == 0


_ops = st.lists(
    st.tuples(
        st.sampled_from(["apply", "forget", "close"]),
        st.sampled_from(["a:1", "b:2", "c:3"]),
        st.integers(0, 1),  # the connection
        st.sets(st.integers(0, 7)),
        st.sets(st.integers(0, 7)),
        st.booleans(),
    ),
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(_ops)
def test_peer_index_matches_a_model(
    ops: list[tuple[str, str, int, set[int], set[int], bool]],
) -> None:
    """PeerIndex against a plain model: per node, the keys of the connection that spoke last."""
    index, conns = PeerIndex(), [object(), object()]
    model: dict[str, tuple[int, set[int]]] = {}
    for op, node, conn, add, drop, full in ops:
        if op == "apply":
            keys = (
                model[node][1] if node in model and model[node][0] == conn and not full else set()
            )
            keys = (keys - drop) | add
            model[node] = (conn, keys)
            index.apply(
                node, conns[conn], [bytes([k]) for k in add], [bytes([k]) for k in drop], full
            )
        elif op == "forget":
            model.pop(node, None)
            index.forget(node)
        else:
            model = {n: v for n, v in model.items() if v[0] != conn}
            index.forget_owner(conns[conn])
        for k in range(8):
            holders = {n for n, (_, ks) in model.items() if k in ks}
            got = index.locate(bytes([k]))
            assert (got is None) == (not holders) and (got is None or got in holders)
        assert index.pages() == sum(len(ks) for _, ks in model.values())


def test_bad_peer_address_is_a_value_error() -> None:
    async def main() -> None:
        async with servers(1) as (a,):
            with pytest.raises(ValueError, match="host:port"):
                a.add_peer("nowhere")
            assert not a.add_peer(a.address)

    asyncio.run(main())


# -- three real processes ------------------------------------------------------------------
async def _serve() -> None:
    """The server process: waits for ``peer ADDRESS`` (or ``peer -``) on stdin, then serves."""
    loop = asyncio.get_running_loop()
    line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
    peers = [line[1]] if len(line) == 2 and line[1] != "-" else []
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=16 * PAGE, codec=None)
    async with store, PageServer(store, secret=SECRET, peers=peers, sync_interval=SYNC) as srv:
        print("READY", srv.address, flush=True)
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).split()
            if not line or line[0] == "quit":
                return
            if line[0] == "fill":
                store_pages(store, int(line[1]))
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

    def start(self, peer: str) -> Proc:
        (self.address,) = self.command(f"peer {peer}", "READY")
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
def procs() -> Iterator[list[Proc]]:
    """Three server processes: a alone, b and c seeded with a's address."""
    started = [Proc() for _ in range(3)]  # together: each costs seconds of imports
    try:
        seed = started[0].start("-").address
        for p in started[1:]:
            p.start(seed)
        yield started
    finally:
        for p in started:
            p.quit()  # all at once: each takes seconds to exit
        for p in started:
            p.stop()


def test_three_processes_share_a_directory(procs: list[Proc]) -> None:
    asyncio.run(_three_processes(procs))


async def _three_processes(procs: list[Proc]) -> None:
    addrs = [p.address for p in procs]
    keys = []
    for i, p in enumerate(procs):
        p.command(f"fill {i}", "FILLED")
        keys += page_keys(i)
    want = [a for a in addrs for _ in range(4)]
    async with client(addrs[2]) as cc:  # c heard of b only through a

        async def all_known() -> bool:
            return await cc.locate(keys) == want

        await wait_until(all_known, "c locates every page")
    local = np.zeros((12, PAGE), np.uint8)
    async with RemoteCluster(addrs[2], secret=SECRET, spec=SPEC, timeout=TIMEOUT) as rc:
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
        procs[1].proc.kill()  # b dies: its watcher hears it, its pages leave the directories
        procs[1].proc.wait()
        with pytest.raises(PeerGoneError):
            await asyncio.wait_for(anext(on_b), TIMEOUT)
        await on_b.aclose()
    async with client(addrs[0]) as ca:

        async def b_forgotten() -> bool:
            return await ca.locate(keys) == [addrs[0]] * 4

        await wait_until(b_forgotten, "a forgot the killed b")

        async def c_changed() -> bool:
            return (
                await ca.locate(keys[8:] + fresh) == []
                and await ca.locate(fresh) == [addrs[2]] * 16
            )

        await wait_until(c_changed, "a knows c's departures and its new pages")


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    asyncio.run(_serve())
