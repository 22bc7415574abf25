"""Close paths are bounded and never leave things half-closed (the family of drain's missing
deadline): a hung disk write does not hold DiskPages.close past its timeout (what the write
uses is released when it ends, never under it); a store whose transfer hangs past the timeout
still closes its disk tier (its lock released) before raising; a remote source whose publish
swallows cancellation does not hold the store's close."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import tierkv.disk.io as dio
from tierkv import Device, Host, Remote
from tierkv.disk import DiskInUseError, DiskPages, StoreStatus
from tierkv.errors import StoreTimeoutError
from tierkv.store import KVStore
from tierkv.tiers import DEVICE

sys.path.insert(0, str(Path(__file__).parent))
from dict_source import DictSource
from disk_util import key, open_disk, page, rows
from held_copies import hold_copies
from store_kv import PAGE, SPEC, fill
from store_kv import store as disk_store


def test_a_hung_disk_write_does_not_hold_close_past_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails on the old code: close(timeout=0.2) waited for the hung write (the pool's
    shutdown joined its thread whatever the timeout)."""
    disk = open_disk(tmp_path, slots=4)
    gate = threading.Event()
    write = dio.SlotIO.write_batch

    def hung(self: Any, items: Any, scratch: Any) -> Any:
        gate.wait(20)
        return write(self, items, scratch)

    monkeypatch.setattr(dio.SlotIO, "write_batch", hung)
    src = rows(1, disk.page_bytes)
    src[0][:] = page(key(1), disk.page_bytes)
    writing = disk.submit_write([key(1)], src)
    closer = threading.Thread(target=disk.close, args=(0.2,))
    closer.start()
    closer.join(10)
    try:
        assert not closer.is_alive(), "close waited for the hung write"
        with pytest.raises(DiskInUseError):  # the write still runs: its files and lock kept
            DiskPages.open(tmp_path, page_bytes=disk.page_bytes, disk_bytes=4 * 8192)
    finally:
        gate.set()
    assert writing.result(10) == [StoreStatus.STORED]
    closer.join(10)
    for _ in range(200):  # released when the write ended (on a thread of its own)
        try:
            again = open_disk(tmp_path, slots=4)
        except DiskInUseError:
            threading.Event().wait(0.01)
            continue
        break
    else:
        raise AssertionError("the lock was never released")
    with again:
        assert again.lookup([key(1)]) == [0]


async def test_a_store_whose_copy_hangs_past_close_still_closes_its_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close raises StoreTimeoutError (a transfer outlasted the timeout) after letting go of
    the rest: the disk's lock is free. Fails on the old code (the error left before the disk
    tier was closed: its lock held for the life of the process)."""
    monkeypatch.setenv("TIERKV_INLINE_COPIES", "0")
    store = disk_store(tmp_path, timeout=0.3)
    await store.open()
    gate = hold_copies(monkeypatch, store, DEVICE)
    try:
        await fill(store, "a", 1)  # its write-behind (device -> host) hangs
        with pytest.raises(StoreTimeoutError, match="transfers not done"):
            await asyncio.wait_for(store.close(), 10)
        assert store.closed and store.sequence_ids() == []
        await store.close()  # a second close: nothing left to do
        async with disk_store(tmp_path) as again:  # the lock is free: another store opens it
            again.check()
    finally:
        gate.set()


class SwallowingSource(DictSource):
    """A source whose publish ignores cancellation until released (a client library that
    turns a cancel into something else and carries on)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.publishing = asyncio.Event()

    async def publish(self, keys: list[bytes], array: Any, slots: list[int]) -> int:
        self.publishing.set()
        while not self.release.is_set():
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                continue
        return 0


async def test_a_publish_that_swallows_cancel_does_not_hold_close() -> None:
    """Fails on the old code: the pusher's aclose awaited its cancelled task without bound."""
    source = SwallowingSource()
    chain = [Device(bytes=6 * PAGE), Host(bytes=8 * PAGE), Remote(sources=[source])]
    store = KVStore(SPEC, tiers=chain, remote_push_wait=0.0, timeout=0.3)
    await store.open()
    try:
        for i in range(6):  # the host fills: its victims are pushed
            await fill(store, f"s{i}", i)
        await asyncio.wait_for(source.publishing.wait(), 10)
        closing = asyncio.ensure_future(store.close())
        done, _ = await asyncio.wait([closing], timeout=10)
        assert done, "close waited for the publish that swallowed its cancel"
        with pytest.raises(StoreTimeoutError, match="transfers not done"):
            closing.result()  # (the publish, a job of the engine, outlasted the timeout)
        assert store.closed
    finally:
        source.release.set()
        await asyncio.sleep(0)
    assert not source.pages
