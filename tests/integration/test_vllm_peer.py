"""tierkv's page-server tier inside vLLM 0.33's tiering manager: the fs reference script against
a real ``tierkv serve`` process, a prefix stored by one process that is a hit for another, the
page server killed mid-sequence and restarted, config checks at startup. Skipped where vLLM is
not installed."""

from __future__ import annotations

import glob
import itertools
import logging
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import vllm_driver as drv  # (skips this module where vLLM is not installed)
from page_server_proc import SECRET, PageServerProc
from vllm_driver import TIERKV, Script, build, key

from tierkv.integrations.vllm import TierKVPeerTier, VllmTierConfigError, VllmTierTypeError

CHUNK = 512 << 10  # vllm_driver's default chunk: 8 blocks of 64 KiB


@pytest.fixture(scope="module")
def server() -> Any:
    with PageServerProc(CHUNK, pages=64) as srv:
        yield srv


def peer_tier(address: str, **kw: Any) -> dict[str, Any]:
    return {"type": "TierKVPeerTier", "module_path": TIERKV, "peers": [address],
            "secret": SECRET, "timeout": 2.0, **kw}  # fmt: skip


def test_peer_tier_answers_as_vllms_fs_tier_bit_exact(tmp_path: Path, server: Any) -> None:
    reference, ours, stats = drv.side_by_side(tmp_path, peer_tier(server.address), b"fs-ref")
    assert ours.log == reference.log
    assert reference.mismatches == ours.mismatches == 0
    assert stats["peer_stored"] == 24 and stats["peer_loaded"] >= 24
    assert stats["peer_errors"] == 0
    assert stats["jobs_failed"] == 0 and stats["jobs_done"] >= 6 + 24


def test_a_prefix_stored_by_one_process_is_a_hit_for_another(server: Any) -> None:
    drv.check_shared(peer_tier(server.address), peer_tier(server.address))


def test_page_server_killed_mid_sequence_and_restarted() -> None:
    """Killed (SIGKILL): stores fail and lookups miss, no exception into vLLM; restarted on
    the same port (empty, as after a crash): the tier reconnects and serves new chunks."""
    with PageServerProc(CHUNK, pages=32) as srv:
        s = Script(build([peer_tier(srv.address, retry_after=0.0, timeout=1.0)], cpu_chunks=4))
        tier = s.manager.secondary_tiers[0]
        assert isinstance(tier, TierKVPeerTier)
        before = [key(300 + i) for i in range(8)]
        during = [key(400 + i) for i in range(8)]
        after = [key(500 + i) for i in range(8)]
        try:
            drv.stores(s, before, "a")
            assert tier.tierkv_stats()["jobs_failed"] == 0
            srv.kill()
            drv.stores(s, during, "b")  # cascades fail: vLLM is told, nothing raises
            failed = tier.tierkv_stats()["jobs_failed"]
            assert failed >= 2
            # evicted from the 4-chunk primary, and the server is gone: misses
            assert s.lookup("r1", before[:4]) == ["MISS"] * 4
            s.end("r1")
            s.settle()
            srv.restart()
            drv.stores(s, after, "c")
            assert tier.tierkv_stats()["jobs_failed"] == failed
            assert s.lookup("r2", after[:4]) == ["HIT"] * 4
            assert s.lookup("r3", during[:2]) == ["MISS"] * 2  # never stored anywhere
            s.end("r2")
            s.end("r3")
            s.settle()
            assert s.mismatches == 0
        finally:
            s.close()


def test_a_load_whose_server_died_after_the_lookup_is_a_miss() -> None:
    with PageServerProc(CHUNK, pages=32) as srv:
        drv.check_gone_after_a_hit(peer_tier(srv.address, retry_after=0.0, timeout=1.0), srv.kill)


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"colour": "blue"}, VllmTierConfigError, "unknown config field"),
        ({"peers": "127.0.0.1:7600"}, VllmTierTypeError, "peers"),
        ({"peers": [7600]}, VllmTierConfigError, "host:port"),
        ({"peers": ["nohostport"]}, VllmTierConfigError, "host:port"),
        ({"peers": None}, VllmTierConfigError, "directory"),
        ({"peers": [], "directory": "http://x"}, VllmTierConfigError, "directory"),
        ({"secret": "not hex"}, VllmTierConfigError, "hex"),
        ({"secret": ""}, VllmTierConfigError, "empty"),
        ({"transport": "carrier-pigeon"}, VllmTierConfigError, "transport"),
        ({"timeout": "2s"}, VllmTierTypeError, "timeout"),
    ],
)
def test_a_bad_config_is_a_typed_error_at_startup(
    fields: dict[str, Any], error: type[Exception], words: str
) -> None:
    threads = threading.active_count()
    engine = f"tierkv-peer-bad-{os.getpid()}"
    with pytest.raises(error, match=words):
        build([peer_tier("127.0.0.1:1", **fields)], engine=engine)
    assert threading.active_count() == threads  # no loop thread left
    assert glob.glob(f"/dev/shm/vllm_offload_{engine}*") == []


def test_a_server_that_refuses_us_or_serves_another_page_size_is_a_startup_error(
    server: Any,
) -> None:
    with pytest.raises(VllmTierConfigError, match="refused"):
        build([peer_tier(server.address, secret="0badbeef")])
    with pytest.raises(VllmTierConfigError, match="pages of 524288 bytes"):
        build([peer_tier(server.address)], blocks_per_chunk=4)  # 256 KiB chunks
    threads = threading.active_count()
    with pytest.raises(VllmTierConfigError, match="offers"):
        build([peer_tier(server.address, transport="shm")])  # the server offers tcp only
    assert threading.active_count() == threads


def test_an_unreachable_server_is_no_startup_error() -> None:
    drv.check_unreachable(peer_tier("127.0.0.1:1", timeout=0.5))  # nothing listens there


def silent_seeds(n: int) -> tuple[list[socket.socket], list[str]]:
    """``n`` listening sockets that never accept (a connect completes, nothing answers)."""
    socks = [socket.create_server(("127.0.0.1", 0), backlog=8) for _ in range(n)]
    return socks, [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]


def test_silent_seeds_are_checked_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Seeds that drop traffic: startup checks them all at once (it checked them one after
    another: vLLM's startup blocked 4 x timeout per seed), each logged as not answering yet,
    none an error; its deadline does not grow with the seeds."""
    socks, seeds = silent_seeds(5)
    inside, most = [0], [0]
    check = TierKVPeerTier._check_seed

    async def counted(self: TierKVPeerTier, name: str, address: str) -> None:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        try:
            await check(self, name, address)
        finally:
            inside[0] -= 1

    monkeypatch.setattr(TierKVPeerTier, "_check_seed", counted)
    try:
        with caplog.at_level(logging.WARNING, "tierkv.integrations.vllm"):
            s = Script(build([dict(peer_tier(seeds[0], timeout=0.2), peers=seeds)]))
            s.close()
    finally:
        for sock in socks:
            sock.close()
    assert most[0] == len(seeds) and inside[0] == 0
    silent = [r for r in caplog.records if "does not answer yet" in r.getMessage()]
    assert sorted(a for a in seeds for r in silent if a in r.getMessage()) == sorted(seeds)
    deadline = s.manager.secondary_tiers[0].start_deadline
    assert deadline({"timeout": 0.2, "peers": seeds}) == deadline({"timeout": 0.2, "peers": []})


def test_a_refusing_seed_among_silent_ones_is_the_startup_error(server: Any) -> None:
    """The checks run at once; the refusal is still the error, with every client closed and
    no loop thread left."""
    socks, seeds = silent_seeds(3)
    threads = threading.active_count()
    try:
        with pytest.raises(VllmTierConfigError, match=f"{server.address} refused"):
            tier = peer_tier(server.address, secret="0badbeef", timeout=0.2)
            build([dict(tier, peers=[*seeds[:2], server.address, seeds[2]])])
    finally:
        for sock in socks:
            sock.close()
    assert threading.active_count() == threads


def test_a_directory_finds_chunks_another_node_holds() -> None:
    """Two page servers registered in a Redis directory: an instance storing to node A, then
    an instance whose only seed is node B finds the chunks through the directory and loads
    them from A, bit-exact."""
    redis_server = pytest.importorskip("redis_server")
    redis_server.skip_without_redis()
    with redis_server.RedisServer() as rs:
        directory = ("--directory", rs.url, "--directory-ttl", "30")
        with (
            PageServerProc(CHUNK, 32, extra=directory) as a,
            PageServerProc(CHUNK, 32, extra=directory) as b,
        ):
            keys = [key(1200 + i) for i in range(4)]
            s = Script(build([peer_tier(a.address, directory=rs.url)], cpu_chunks=4))
            try:
                drv.stores(s, keys, "w")
            finally:
                s.close()
            t = Script(build([peer_tier(b.address, directory=rs.url)], cpu_chunks=4))
            try:
                deadline = time.monotonic() + 30  # the directory hears of A's pages at once,
                answers: list[str] = []  # bounded here anyway
                for i in itertools.count():
                    answers = t.lookup(f"r{i}", keys)
                    t.end(f"r{i}")
                    if answers == ["HIT"] * 4 or time.monotonic() > deadline:
                        break
                    time.sleep(0.2)
                assert answers == ["HIT"] * 4
                assert t.mismatches == 0
                st = t.manager.secondary_tiers[0].tierkv_stats()
                assert st[f"peer_loaded_from_{a.address}"] == 4
                t.settle()
            finally:
                t.close()
