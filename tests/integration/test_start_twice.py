"""Starting what is started already: a page server's second `start` raised only after it had
replaced its transports and closed the running server (the port was taken by itself); a
RemoteTier's second `connect` and a Watch's second `start` opened another control connection
and dropped the first unclosed (a socket and a reader task leaked per call). Now the server
refuses a second start and keeps serving; the clients' second call returns at once."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "tierkv"))
from store_kv import PAGE, SPEC

from tierkv.remote import PageServer, RemoteError, RemoteTier, Watch
from tierkv.store import KVStore

SECRET = b"start-twice-secret"


async def _sessions(srv: PageServer, n: int) -> None:
    for _ in range(200):  # (the server counts a session once its handshake ended)
        if srv.stats()["sessions"] == n:
            return
        await asyncio.sleep(0.01)
    assert srv.stats()["sessions"] == n


async def test_a_started_server_refuses_a_second_start_and_keeps_serving() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, codec=None) as s:
        srv = PageServer(s, secret=SECRET)
        await srv.start()
        try:
            with pytest.raises(RemoteError, match="started already"):
                await srv.start()
            tier = RemoteTier(f"127.0.0.1:{srv.port}", secret=SECRET)
            await tier.connect()  # (was PeerGoneError: the second start closed the server)
            await tier.aclose()
        finally:
            await srv.aclose()
        with pytest.raises(RemoteError, match="started already"):
            await srv.start()  # a closed server does not come back half-way
        await srv.aclose()  # idempotent


async def test_a_second_connect_or_start_opens_no_second_connection() -> None:
    store = KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, codec=None)
    async with store, PageServer(store, secret=SECRET) as srv:
        address = f"127.0.0.1:{srv.port}"
        tier = RemoteTier(address, secret=SECRET)
        watch = Watch(address, secret=SECRET)
        try:
            assert await tier.connect() is tier
            assert await tier.connect() is tier
            assert await watch.start() is watch
            assert await watch.start() is watch
            await _sessions(srv, 2)  # (was 4: two leaked, open until the GC ran)
        finally:
            await tier.aclose()
            await watch.aclose()
        await _sessions(srv, 0)
        await tier.connect()  # a closed client connects again
        await _sessions(srv, 1)
        await tier.aclose()
