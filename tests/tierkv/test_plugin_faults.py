"""A plug-in tier that misbehaves (its lookup raises, answers too few entries or None, its close
raises: a new user's bug, or its medium gone) costs the store misses, counted and logged in
``stats()[kind]``, never an untyped error out of lookup / add_sequence / fetch_prefix / close
(tierkv.chain.LowerChain); the store stays consistent."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from tierkv import Host, KVStore
from tierkv.chain_plugins import register_tier, unregister_tier
from tierkv.errors import TierConfigError, TierKVError, TierTypeError
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


HOOK: dict[str, str | None] = {"fails": None}


@dataclass(frozen=True)
class Buggy(Mmap):
    """A plug-in entry whose hooks fail as ``HOOK["fails"]`` says."""

    kind: ClassVar[str] = "buggy"

    def check(self, spec: KVSpec) -> None:
        if HOOK["fails"] == "check":
            raise ValueError("a bug in check")
        super().check(spec)

    def open(self, spec: KVSpec) -> MmapTier:
        if HOOK["fails"] == "open":
            raise OSError("cannot open the medium")
        if HOOK["fails"] == "open-none":
            return None  # type: ignore[return-value]
        return super().open(spec)

    def register_moves(self, moves: object) -> None:
        if HOOK["fails"] == "register_moves":
            raise KeyError("a bug in register_moves")
        super().register_moves(moves)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fails", "error", "match"),
    [
        ("check", TierConfigError, "'buggy': check failed: ValueError: a bug in check"),
        ("open", TierConfigError, "'buggy': open failed: OSError: cannot open"),
        ("open-none", TierTypeError, "'buggy': open gave NoneType, not a Tier"),
        ("register_moves", TierConfigError, "'buggy': register_moves failed: KeyError"),
    ],
)
async def test_a_plug_in_whose_hook_fails_is_a_typed_error_with_nothing_left(
    tmp_path: Path, fails: str, error: type[Exception], match: str
) -> None:
    """Fails on the old code: ValueError, OSError, AttributeError, KeyError out of KVStore()
    or its open."""
    register_tier(Buggy)
    HOOK["fails"] = fails
    try:
        with pytest.raises(error, match=match) as got:
            s = KVStore(
                SPEC, tiers=[Host(bytes=8 * PAGE), Buggy(path=tmp_path / "m", bytes=80 * PAGE)]
            )
            await s.open()
        assert isinstance(got.value, TierKVError)
        assert os.listdir(tmp_path) == []  # nothing left behind
    finally:
        unregister_tier("buggy")
        HOOK["fails"] = None
