"""Background failures reach the ``tierkv`` logger (rate limited, with the kind, the tier and the
page keys) as well as the owners' counters."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from tierkv.errors import TransferFailedError
from tierkv.failures import FailureLog
from tierkv.store import KVStore

from .test_store import PAGE, SPEC, fill, tokens


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def records(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == name]


def test_one_record_per_kind_per_interval_then_the_count_of_the_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    log = FailureLog("tierkv.test", interval=10.0, clock=clock)
    keys = [bytes([i]) * 16 for i in range(6)]
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        text = log.report("compression", ValueError("bad page"), tier="cold", keys=keys)
        assert text == "ValueError: bad page"  # what the owner keeps as last_error
        for _ in range(3):  # within the interval: counted, not logged
            clock.now += 1.0
            log.report("compression", ValueError("again"), tier="cold", keys=keys)
        log.report("prefetch", OSError("other kind"), tier="device")  # its own window
        clock.now += 10.0
        log.report("compression", ValueError("later"), tier="cold", keys=keys[:1])
    got = records(caplog, "tierkv.test")
    assert [r.tierkv_kind for r in got] == ["compression", "prefetch", "compression"]  # type: ignore[attr-defined]
    first, other, last = got
    assert first.levelno == logging.WARNING and first.exc_info is not None
    msg = first.getMessage()
    assert "compression" in msg and "tier cold" in msg and "6 pages" in msg
    assert keys[0].hex() in msg and keys[3].hex() in msg and keys[4].hex() not in msg
    assert first.tierkv_keys == [k.hex() for k in keys]  # type: ignore[attr-defined]
    assert first.tierkv_tier == "cold"  # type: ignore[attr-defined]
    assert "OSError: other kind" in other.getMessage()
    assert last.tierkv_suppressed == 3  # type: ignore[attr-defined]
    assert "3 more compression failures not logged" in last.getMessage()
    assert "ValueError: later" in last.getMessage()


def test_a_log_without_tracebacks_warns_in_one_line_and_traces_at_debug(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = FailureLog("tierkv.test.short", tracebacks=False)
    try:
        raise ConnectionError("refused")
    except ConnectionError as exc:
        failure = exc
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        log.report("directory sync", failure, tier="directory")
    (warned,) = records(caplog, "tierkv.test.short")
    assert warned.exc_info is None and warned.getMessage().count("\n") == 0
    assert "ConnectionError: refused" in warned.getMessage()
    caplog.clear()
    log = FailureLog("tierkv.test.short", tracebacks=False)
    with caplog.at_level(logging.DEBUG, logger="tierkv"):
        log.report("directory sync", failure, tier="directory")
    warned, traced = records(caplog, "tierkv.test.short")
    assert warned.exc_info is None and warned.levelno == logging.WARNING
    assert traced.levelno == logging.DEBUG and traced.exc_info is not None
    assert traced.exc_info[1] is failure


def test_nothing_is_formatted_when_the_logger_is_off(caplog: pytest.LogCaptureFixture) -> None:
    log = FailureLog("tierkv.quiet")
    logging.getLogger("tierkv.quiet").setLevel(logging.CRITICAL)
    try:
        assert log.report("x", ValueError("v")) == "ValueError: v"
    finally:
        logging.getLogger("tierkv.quiet").setLevel(logging.NOTSET)
    assert records(caplog, "tierkv.quiet") == []


async def test_a_failed_write_behind_is_counted_and_logged_with_its_pages(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        seen: list[list[bytes]] = []

        async def broken(keys: list[bytes]) -> int:
            seen.append(list(keys))
            raise TransferFailedError("the copy engine broke")

        monkeypatch.setattr(store.tiers.pages, "write_behind", broken)
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            await fill(store, "a", 1, n=6)  # the lease ends: a write-behind task starts
            await store.drain()
        assert store.counters.background_errors == 1
        assert store.counters.last_error == "TransferFailedError: the copy engine broke"
        (rec,) = records(caplog, "tierkv.store")
        assert rec.tierkv_kind == "write-behind" and rec.tierkv_tier == "host"  # type: ignore[attr-defined]
        assert seen and rec.tierkv_keys == [k.hex() for k in seen[0]]  # type: ignore[attr-defined]
        assert "the copy engine broke" in rec.getMessage()


async def test_a_failed_prefetch_task_names_its_pages(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=40 * PAGE, codec=None) as store:
        await fill(store, "a", 1, n=6)

        def broken(*_: Any) -> list[bytes]:
            raise RuntimeError("room planning failed")

        monkeypatch.setattr(store.tiers.room, "device_room", broken)
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            await store.prefetch(["a"])
            await store.drain()
        assert store.counters.background_errors == 1
        (rec,) = records(caplog, "tierkv.store")
        assert rec.tierkv_kind == "prefetch" and rec.tierkv_tier == "device"  # type: ignore[attr-defined]
        pages = store.sequence("a").all_pages(None)
        assert rec.tierkv_keys == [k.hex() for k in pages]  # type: ignore[attr-defined]


class BrokenSource:
    """A remote tier whose every call fails."""

    async def lookup(self, keys: list[bytes]) -> int:
        raise ConnectionResetError("lookup: the peer went away")

    async def load(self, keys: list[bytes], array: npt.NDArray[np.uint8], slots: list[int]) -> int:
        raise ConnectionResetError("load: the peer went away")

    async def publish(
        self, keys: list[bytes], array: npt.NDArray[np.uint8], slots: list[int]
    ) -> int:
        raise ConnectionResetError("publish: the peer went away")


async def test_remote_read_failures_are_logged_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = KVStore(
        SPEC, device_bytes=16 * PAGE, host_bytes=40 * PAGE, codec=None, remote=BrokenSource()
    )
    async with store:
        with caplog.at_level(logging.WARNING, logger="tierkv"):
            for i in range(3):  # three lookups fail within one interval: one record
                await store.add_sequence(f"s{i}", tokens(i + 1, 9))
        remote = store.stats()["remote"]
        assert remote["errors"] == 3 and "went away" in remote["last_error"]
        got = records(caplog, "tierkv.remote")
        assert len(got) == 1 and got[0].tierkv_kind == "remote lookup"  # type: ignore[attr-defined]
        assert got[0].tierkv_tier == "remote" and len(got[0].tierkv_keys) == 4  # type: ignore[attr-defined]


async def test_a_page_servers_unreachable_directory_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A page server's directory agent whose Redis refuses connections starts anyway (serving
    pages does not need it), counts the failure and logs it, rate limited."""
    import socket

    pytest.importorskip("redis")
    from tierkv.remote.membership.agent import DirectoryAgent
    from tierkv.remote.membership.redis_directory import RedisDirectory

    with socket.socket() as s:  # a free port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    agent = DirectoryAgent(RedisDirectory(f"redis://127.0.0.1:{port}/0", timeout=0.5), "a:1", set)
    with caplog.at_level(logging.WARNING, logger="tierkv"):
        await agent.start()
        await agent.aclose()
    got = records(caplog, "tierkv.remote.directory")
    assert got and "directory start" in got[0].getMessage()
    assert got[0].tierkv_tier == "directory"  # type: ignore[attr-defined]
    assert agent.errors >= 1 and not agent.registered
