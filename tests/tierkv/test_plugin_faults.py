"""A plug-in tier that misbehaves (its lookup raises, answers too few entries or None, its close
raises: a new user's bug, or its medium gone) costs the store misses, counted and logged in
``stats()[kind]``, never an untyped error out of lookup / add_sequence / fetch_prefix / close
(tierkv.chain.LowerChain); the store stays consistent."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from tierkv import Host, KVStore
from tierkv.chain_plugins import register_tier, unregister_tier
from tierkv.mmap_tier import MMAP, Mmap, MmapTier
from tierkv.spec import KVSpec

sys.path.insert(0, str(Path(__file__).parent))
from store_kv import PAGE, SPEC, fill, tokens

FAULTY = "faulty"
MODE: dict[str, str | None] = {"now": None}


class FaultyTier(MmapTier):
    """The mmap tier (its medium and moves), but its lookup and close fail as ``MODE["now"]``
    says."""

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        now = MODE["now"]
        if now == "short":
            return [True] * (len(keys) // 2)
        if now == "raise":
            raise OSError("the medium is gone")
        if now == "none":
            return None  # type: ignore[return-value]
        return super().lookup(keys)

    def close(self) -> None:
        super().close()
        if MODE["now"] == "close":
            raise OSError("close failed")


@dataclass(frozen=True)
class Faulty(Mmap):
    kind: ClassVar[str] = FAULTY

    def open(self, spec: KVSpec) -> MmapTier:
        return FaultyTier.open(self.path, page_bytes=spec.page_bytes, nbytes=self.bytes)


@pytest.fixture
def registered() -> Iterator[None]:
    register_tier(Faulty)
    MODE["now"] = None
    try:
        yield
    finally:
        unregister_tier(FAULTY)
        MODE["now"] = None


@pytest.mark.parametrize("mode", ["short", "raise", "none"])
async def test_a_failing_lookup_is_a_counted_miss(
    registered: None, tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails on the old code: ValueError (zip strict), OSError or TypeError out of lookup,
    add_sequence and fetch_prefix."""
    s = KVStore(SPEC, tiers=[Host(bytes=8 * PAGE), Faulty(path=tmp_path / "m", bytes=80 * PAGE)])
    async with s:
        for i in range(8):  # sequence 0's blocks leave the host for the plug-in tier
            await fill(s, f"s{i}", i)
        await s.drain()
        assert s.lookup(tokens(0)) == 8  # (healthy: found below the host)
        MODE["now"] = mode
        assert s.lookup(tokens(0)) == 0
        assert await s.fetch_prefix(tokens(1)) == 0
        assert await s.add_sequence("x", tokens(0)) == 0
        st = s.stats()[MMAP]
        assert st["errors"] >= 3 and st["chain_last_error"], st
        assert "lower tier lookup failed on tier mmap" in caplog.text
        await s.release("x")
        for i in range(8, 12):  # evictions go on: their writes to the tier counted as failed
            await fill(s, f"s{i}", i)
        await s.drain()
        assert s.stats()[MMAP]["write_failed"] > 0
        s.check()
        MODE["now"] = None


async def test_a_close_that_fails_is_counted_and_the_store_closes(
    registered: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Fails on the old code: the plug-in's OSError left close() (untyped)."""
    s = KVStore(SPEC, tiers=[Host(bytes=8 * PAGE), Faulty(path=tmp_path / "m", bytes=80 * PAGE)])
    await s.open()
    await fill(s, "a", 1)
    MODE["now"] = "close"
    await s.close()
    assert s.closed and "lower tier close" in caplog.text
