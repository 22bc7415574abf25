"""A plug-in tier that misbehaves (tierkv.chain_plugins), around a real mmap tier: its check,
open or register_moves raising a plain exception, its open returning something that is not a
Tier or a tier of another medium, its lookup raising or answering the wrong length, its moves
raising, its stats or close raising. Each reached the store's caller as an untyped
RuntimeError / AttributeError / ValueError (an eviction failing the lease that caused it);
now: a typed error at construction or open with nothing left open, and at run time a counted
failure of that tier (the pages stay in the host, every read back is right), as the built-in
disk tier's failures are. (test_plugin_faults.py tests the same hooks on another plug-in.)"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tierkv import Host
from tierkv import errors as e
from tierkv.chain_plugins import register_tier, unregister_tier
from tierkv.mmap_tier import Mmap, MmapTier, _load, _save
from tierkv.store import KVStore
from tierkv.tier_names import HOST

sys.path.insert(0, str(Path(__file__).parent))
from store_kv import PAGE, SPEC, cached_kv, fill

KIND = "faulty"
SEQS = 8  # 64 pages of content through a host tier of 8: most go down to the plug-in


def boom(*_: object, **__: object) -> Any:
    raise RuntimeError("a plug-in's bug")


class _Wrapped:
    """A real mmap tier under the plug-in's kind, with some of its methods replaced."""

    def __init__(self, tier: MmapTier, **over: Callable[..., Any]) -> None:
        self._tier, self._over = tier, {"medium": lambda: KIND, **over}

    @property
    def unwrapped(self) -> MmapTier:
        return self._tier

    def __getattr__(self, name: str) -> Any:
        if name == "medium":  # (a value, the others are methods)
            medium: Any = self._over["medium"]
            return medium() if callable(medium) else medium
        return self._over[name] if name in self._over else getattr(self._tier, name)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Faulty(Mmap):
    """The mmap tier's entry under another kind, its faults chosen per test."""

    kind: ClassVar[str] = KIND
    faults: ClassVar[dict[str, Any]] = {}

    def check(self, spec: Any) -> None:
        self.faults.get("check", Mmap.check)(self, spec)

    def open(self, spec: Any) -> Any:
        if "open" in self.faults:
            return self.faults["open"](self, spec)
        tier = MmapTier.open(self.path, page_bytes=spec.page_bytes, nbytes=self.bytes)
        return _Wrapped(tier, **self.faults.get("tier", {}))

    def register_moves(self, moves: Any) -> None:
        if "register_moves" in self.faults:
            return self.faults["register_moves"](self, moves)
        moves.register(HOST, KIND, self.faults.get("save", _save))
        moves.register(KIND, HOST, self.faults.get("load", _load))
        return None


@pytest.fixture
def faulty() -> Iterator[dict[str, Any]]:
    register_tier(Faulty)
    Faulty.faults = {}
    try:
        yield Faulty.faults
    finally:
        unregister_tier(KIND)


def _store(tmp_path: Path) -> KVStore:
    return KVStore(SPEC, tiers=[Host(bytes=8 * PAGE), Faulty(path=tmp_path / "kv.map",
                                                             bytes=80 * PAGE)])  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        ({"check": boom}, e.TierConfigError),
        ({"open": boom}, e.TierConfigError),
        ({"open": lambda self, spec: None}, e.TierTypeError),  # AttributeError at its close
        ({"tier": {"medium": "disk"}}, e.TierTypeError),  # another tier's medium
        ({"register_moves": boom}, e.TierConfigError),
    ],
    ids=["check", "open", "open-None", "medium", "register_moves"],
)
async def test_a_plugin_failing_to_start_is_a_typed_error_with_nothing_open(
    tmp_path: Path, faulty: dict[str, Any], fault: dict[str, Any], error: type[Exception]
) -> None:
    faulty.update(fault)
    with pytest.raises(error) as got:
        async with _store(tmp_path):
            pass
    assert "register_moves" in fault or KIND in str(got.value)
    assert fault.get("open") is not boom or isinstance(got.value.__cause__, RuntimeError)
    assert os.listdir(tmp_path) == []  # the map a failed start made is gone again


@pytest.mark.parametrize(
    "fault",
    [
        {"tier": {"lookup": boom}},
        {"tier": {"lookup": lambda keys: []}},  # [] was "every page held already"
        {"tier": {"lookup": lambda keys: None}},
        {"tier": {"reserve": boom}},
        {"save": boom},
        {"load": boom},
    ],
    ids=["lookup", "lookup-short", "lookup-None", "reserve", "save", "load"],
)
async def test_a_plugin_failing_at_run_time_is_counted_and_loses_nothing(
    tmp_path: Path, faulty: dict[str, Any], fault: dict[str, Any]
) -> None:
    faulty.update(fault)
    async with _store(tmp_path) as s:
        for i in range(SEQS):
            await fill(s, f"s{i}", i)  # evictions spill to the plug-in: they ran into its bug
        await s.drain()
        got = [await cached_kv(s, i) for i in range(SEQS)]
        assert all(n in (0, 8) for n in got) and got[-1] == 8  # what is read back is right
        st = s.stats()[KIND]
        assert st["errors"] > 0 and st["chain_last_error"]  # counted, with the reason
        s.check()


async def test_a_plugin_whose_stats_or_close_raise_leaves_the_store_working(
    tmp_path: Path, faulty: dict[str, Any]
) -> None:
    faulty["tier"] = {"stats": boom}
    async with _store(tmp_path) as s:
        await fill(s, "s", 0)
        assert "RuntimeError" in s.stats()[KIND]["stats_error"]  # the store's stats still answer
    faulty["tier"] = {"close": boom}
    s = _store(tmp_path)
    await s.open()
    tier = s.tiers.chain[-1]
    assert isinstance(tier, _Wrapped)
    await s.close()  # (counted and logged: a close never fails for a plug-in's bug)
    assert s.closed
    tier.unwrapped.close()  # (the map the failed close left)
