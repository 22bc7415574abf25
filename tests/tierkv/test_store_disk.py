"""The disk tier of the store (issue 25): content pages leaving the host go to disk, prefix
lookups that miss the host find them (also after a restart, in this process or another),
verified: a damaged page is a counted miss, never served; a failed write is never stored."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tierkv.disk import DiskConfigError, DiskInUseError
from tierkv.disk.layout import ALIGN
from tierkv.errors import InvalidInputError, InvalidTypeError, TierSizeError
from tierkv.store import KVStore

sys.path.insert(0, str(Path(__file__).parent))
from store_kv import (
    PAGE,
    SLOT,
    SPEC,
    N,
    cached_kv,
    fill,
    fill_many,
    kv,
    store,
    tokens,
)


async def test_evicted_prefix_pages_come_back_from_disk_bit_exact(tmp_path: Path) -> None:
    async with store(tmp_path) as s:
        await fill_many(s, range(8))  # 8 x 2 blocks x 2 layers = 32 pages, the host holds 8
        d = s.stats()["disk"]
        assert d["stored"] > 0 and d["write_failed"] == 0 and d["used"] == d["stored"]
        assert s.lookup(tokens(0)) == 8  # the lookup sees the disk's pages
        assert await cached_kv(s, 0) == 8
        d = s.stats()["disk"]
        assert d["imported"] >= 4 and d["hits"] >= 4 and d["corrupt_pages"] == 0
        s.check()


async def test_private_pages_never_go_to_disk(tmp_path: Path) -> None:
    from tierkv.keys import is_content, page_key, private_key

    async with KVStore(
        SPEC,
        device_bytes=6 * PAGE,
        host_bytes=16 * PAGE,
        codec="none",
        disk_path=tmp_path,
        disk_bytes=64 * SLOT,
        compress_live=True,
        compress_after=1,
    ) as s:
        await s.add_sequence("live", tokens(99))  # stays live: its last block is private
        async with s.lease(["live"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("live", layer, *kv(N, 990 + layer))
        await fill_many(s, range(8))  # evictions, idle compressions (compress_live) offer pages
        disk = s._chain.tiers[0]  # type: ignore[union-attr]
        on_disk = disk.pages.victims(disk.pages.stats().capacity)
        assert on_disk and all(is_content(k[:18]) for k in on_disk)
        before = s.stats()["disk"]["offered"]
        private = page_key(private_key("live", 2), 0)
        await s._chain.spill([(private, 0)])  # type: ignore[union-attr]  # the filter itself
        assert s.stats()["disk"]["offered"] == before and disk.lookup([private]) == [False]


async def test_restart_in_process_hits_the_earlier_prefix_pages(tmp_path: Path) -> None:
    async with store(tmp_path) as s:
        await fill_many(s, range(8))
    async with store(tmp_path) as s2:  # a new store on the same path: nothing in RAM
        assert s2.stats()["disk"]["recovered"] > 0
        hits = [await cached_kv(s2, i) for i in range(8)]
        assert hits == [8] * 8  # the host's pages went down at close too
        d = s2.stats()["disk"]
        assert d["corrupt_pages"] == 0 and d["imported"] == 8 * 2 * SPEC.num_layers


CHILD = """
import asyncio, sys
sys.path.insert(0, {tests!r})
from test_store_disk import cached_kv, store
from pathlib import Path
from typing import Any

async def main():
    async with store(Path({path!r})) as s:
        print(sum([await cached_kv(s, i) == 8 for i in range(8)]))

asyncio.run(main())
"""


async def test_restart_in_a_subprocess_hits_the_earlier_prefix_pages(tmp_path: Path) -> None:
    async with store(tmp_path) as s:
        await fill_many(s, range(8))
    out = _child(tmp_path)
    assert int(out.split()[-1]) == 8, out  # every prefix, bit-exact (checked in the child)


def _child(path: Path) -> str:
    """Run CHILD in a new interpreter on `path`; its stdout (how many prefixes it hit)."""
    code = CHILD.format(tests=str(Path(__file__).parent), path=str(path))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout


def _segments(path: Path) -> list[Path]:
    return sorted(path.glob("segment-*"))


def _flip_payload_bits(path: Path) -> int:
    """Flip a bit in the payload of every written slot; returns how many."""
    n = 0
    for seg in _segments(path):
        with open(seg, "r+b") as f:
            data = bytearray(f.read())
            for off in range(0, len(data), SLOT):
                if any(data[off : off + 8]):  # a header was written there
                    data[off + ALIGN + 7] ^= 0x10
                    n += 1
            f.seek(0)
            f.write(data)
    return n


async def test_a_flipped_bit_is_a_counted_miss_and_the_prefix_recomputes(tmp_path: Path) -> None:
    async with store(tmp_path) as s:
        await fill_many(s, range(8))
    assert _flip_payload_bits(tmp_path) > 0
    async with store(tmp_path) as s2:
        assert s2.lookup(tokens(0)) == 8  # the index still has it: the read decides
        assert await cached_kv(s2, 0) == 0  # every page damaged: nothing reused, recomputed
        d = s2.stats()["disk"]
        assert d["corrupt_pages"] >= 1 and d["hits"] == 0 and d["import_missed"] >= 1
        assert s2.lookup(tokens(0)) == 0  # the damaged pages were freed
        s2.check()
        from tierkv.metrics import render

        line = f"tierkv_disk_corrupt_pages_total {float(d['corrupt_pages'])}"
        assert line in render(s2).decode()


async def test_failed_writes_are_counted_never_stored(tmp_path: Path) -> None:
    async with store(tmp_path) as s:
        disk = s._chain.tiers[0].pages  # type: ignore[union-attr]
        fds = disk._opened.fds
        saved = [os.dup(fd) for fd in fds]
        ro = [os.open(p, os.O_RDONLY) for p in _segments(tmp_path)]
        try:
            for fd, r in zip(fds, ro, strict=True):
                os.dup2(r, fd)  # every write now fails with EBADF, as ENOSPC would
            await fill_many(s, range(8))
            d = s.stats()["disk"]
            assert d["write_failed"] > 0 and d["stored"] == 0 and d["used"] == 0
            assert d["write_failures"] == d["write_failed"]
            assert s.lookup(tokens(0)) == 0
        finally:
            for fd, sv in zip(fds, saved, strict=True):
                os.dup2(sv, fd)
                os.close(sv)
            for r in ro:
                os.close(r)
        await fill(s, "after", 20)  # the disk goes on once writes succeed again
        await fill_many(s, range(21, 26))
        assert s.stats()["disk"]["stored"] > 0


async def test_bad_disk_configuration_is_typed_and_creates_nothing(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError):
        KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, disk_path=tmp_path)
    with pytest.raises(InvalidInputError):
        KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, disk_bytes=1 << 20)
    with pytest.raises(InvalidTypeError):
        store(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        store(tmp_path, disk_bytes="1G")
    missing = store(tmp_path / "nope")
    with pytest.raises(DiskConfigError):
        await missing.open()
    assert not (tmp_path / "nope").exists()
    with pytest.raises(TierSizeError, match="disk budget holds no page"):  # at entry
        store(tmp_path, disk_bytes=SLOT - 1)
    assert _segments(tmp_path) == [] and not (tmp_path / "layout.json").exists()
    async with store(tmp_path) as s:
        with pytest.raises(DiskInUseError):
            await store(tmp_path).open()
        assert s.stats()["disk"]["used"] == 0


async def test_a_store_without_disk_has_no_lower_tier() -> None:
    async with KVStore(SPEC, device_bytes=6 * PAGE, host_bytes=8 * PAGE, codec=None) as s:
        await fill_many(s, range(4))
        assert "disk" not in s.stats() and s._chain is None
        assert s.tiers.glue.spill is None


async def test_the_disk_tier_is_in_the_metrics(tmp_path: Path) -> None:
    from tierkv.metrics import render

    async with store(tmp_path) as s:
        await fill_many(s, range(8))
        await cached_kv(s, 0)
        text = render(s).decode()
    for name in (
        "tierkv_disk_hits_total",
        "tierkv_disk_corrupt_pages_total 0.0",
        "tierkv_disk_write_failures_total 0.0",
        "tierkv_disk_bytes_written_total",
        'tierkv_disk_io_mode{mode="',
        'tierkv_disk_read_seconds_bucket{le="+Inf"}',
        "tierkv_disk_write_seconds_count",
        "tierkv_disk_used",
    ):
        assert name in text, name
    hits = next(ln for ln in text.splitlines() if ln.startswith("tierkv_disk_hits_total"))
    assert float(hits.split()[-1]) >= 4


async def test_a_read_move_that_cannot_be_queued_rolls_its_host_slots_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: import_host reserved host slots, then the move raised before queueing a
    job; the slots stayed WRITING forever (the remote path had the same hole)."""
    from tierkv.keys import page_key, prefix_keys
    from tierkv.page_table import PageState

    async with store(tmp_path) as s:
        await fill_many(s, range(8))
        blocks = prefix_keys(tokens(0), SPEC.page_tokens, None)[:2]
        pages = [page_key(b, j) for b in blocks for j in range(SPEC.num_layers)]
        chain = s._chain
        assert chain is not None and all(chain.lookup(pages))
        from tierkv.disk import jobs

        def refuse(*_: object, **__: object) -> None:
            raise InvalidInputError("refused before queueing")

        with monkeypatch.context() as m:
            m.setattr(jobs, "submit_load", refuse)  # the move raises: no job is queued
            assert await chain.fetch(pages) == 0  # counted, not raised
        assert s.stats()["disk"]["errors"] == 1
        s.check()
        table = s.tiers.table
        assert not [k for k in table.keys("host") if table.state(k, "host") is PageState.WRITING]
        assert await cached_kv(s, 0) == 8  # and the pages still come back


async def test_a_disk_prefix_longer_than_the_host_imports_what_the_host_holds(
    tmp_path: Path,
) -> None:
    """Regression: an import is all or nothing, so a 14-page prefix on disk into an 8-page
    host imported nothing (14 counted misses, 0 tokens reused)."""
    prompt = list(range(1, 30))  # 7 full blocks and a token to compute
    kw: dict[str, Any] = dict(codec=None, disk_path=tmp_path, disk_bytes=64 * SLOT)
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=32 * PAGE, **kw) as s:
        await s.add_sequence("a", prompt)
        async with s.lease(["a"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("a", layer, *kv(len(prompt), layer))
        await s.release("a")
        await s.drain()
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=8 * PAGE, **kw) as s:
        assert s.lookup(prompt) == 28
        assert await s.add_sequence("b", prompt) == 16  # the 8 pages the host holds
        d = s.stats()["disk"]
        assert d["imported"] == 8 and d["import_missed"] == 0
        async with s.lease(["b"]) as lease:
            for layer in range(SPEC.num_layers):
                k, v = kv(len(prompt), layer)
                got_k, got_v = lease.kv("b", layer)
                assert torch.equal(got_k, k[:, :16]) and torch.equal(got_v, v[:, :16])
