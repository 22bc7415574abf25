"""PageTable.place / land (a step group's pins, room, slots and sources in one call each):
the same table state, events, policy order and tenants' counts as the calls they stand for
(pin_readable, prepare_evict + complete_evict, prepare_store, prepare_load on the source,
then complete_load, complete_store, prepare_load), and where it would need a wait, None with
nothing changed."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import Quota
from tierkv.page_table import PageTable, Placement
from tierkv.tenants import Tenants

DEV, HOST = "device", "host"


def _key(i: int) -> bytes:
    return f"p{i:03d}".encode()


def _table(policy: str, cap: int, tenants: bool) -> tuple[PageTable, Tenants | None]:
    acc = None
    if tenants:
        acc = Tenants({"x": Quota(), "y": Quota()}, {DEV: 1, HOST: 1}, {DEV: cap, HOST: 64})
        acc.charge([_key(i) for i in range(0, 40, 2)], acc.index["x"])
        acc.charge([_key(i) for i in range(1, 40, 2)], acc.index["y"])
    table = PageTable({DEV: cap, HOST: 64}, policy, tenants=acc)
    everything = [_key(i) for i in range(40)]
    alloc = table.prepare_store(everything, HOST)
    assert alloc is not None
    table.complete_store(alloc.keys, HOST)
    return table, acc


def _snapshot(table: PageTable, acc: Tenants | None, order: bool = True) -> object:
    """The table's state; ``order``: with the policy's order (a pin let go records a use)."""
    out: list[object] = []
    for tier in (DEV, HOST):
        keys = sorted(table.keys(tier))
        out.append(
            [(k, table.slot(k, tier), int(table.state(k, tier)), table.pins(k, tier)) for k in keys]
        )
        out.append(table.candidates(tier, 64) if order else None)
        out.append(table.evictable(tier))
    out.append(table.take_events())
    if acc is not None:
        out.append(acc.stats())
    return out


def _by_calls(
    table: PageTable,
    keys: list[bytes],
    clean: Callable[[list[bytes]], bool],
    order: tuple[bytes, ...],
) -> bool:
    """The calls ``place`` and ``land`` stand for (DeviceLoads' no-wait load before them)."""
    ready, rest = table.pin_readable(keys, DEV)
    if not rest:
        return True
    need = len(rest) - (table.capacity(DEV) - table.used(DEV))
    if table.present(rest, DEV) or len(table.readable(rest, HOST)) < len(rest):
        table.complete_load(ready, DEV)
        return False
    if need > 0:
        victims = [
            k
            for k, _ in table.prepare_evict(
                DEV, need, exact=True, keep=frozenset(order), keep_order=order, for_keys=rest
            )
        ]
        if not victims or not clean(victims):
            if victims:
                table.complete_evict(victims, DEV, ok=False)
            table.complete_load(ready, DEV)
            return False
        table.complete_evict(victims, DEV)
    alloc = table.prepare_store(rest, DEV)
    assert alloc is not None and not alloc.evicted
    table.prepare_load(rest, HOST)
    table.complete_load(rest, HOST)
    table.complete_store(rest, DEV)
    table.prepare_load(rest, DEV)
    return True


def _by_place(
    table: PageTable,
    keys: list[bytes],
    clean: Callable[[list[bytes]], bool],
    order: tuple[bytes, ...],
) -> bool:
    keep = frozenset(order)
    got = table.place(
        keys, DEV, HOST, loadable=lambda n: True, clean=clean, keep=keep, keep_order=order
    )
    if got is None:
        return False
    table.land(got, DEV, HOST)
    return True


groups = st.lists(st.lists(st.integers(0, 39), min_size=1, max_size=8, unique=True), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    steps=groups,
    policy=st.sampled_from(["lru", "arc", "s3fifo"]),
    tenants=st.booleans(),
    dirty=st.sets(st.integers(0, 39), max_size=6),
    announce=st.sampled_from([0, 1, 2]),
)
def test_place_and_land_leave_what_the_calls_leave(
    steps: list[list[int]], policy: str, tenants: bool, dirty: set[int], announce: int
) -> None:
    """Groups loaded one after another (each let go before the next), some victims refused
    as not clean (the run ends there): both ways end in the same state, events, policy order
    and counts."""
    bad = {_key(i) for i in dirty}

    def clean(keys: list[bytes]) -> bool:
        return not any(k in bad for k in keys)

    # announced: none, every page (the order alone picks), or half (pages nobody keeps first)
    order = tuple(_key(i) for i in range(39, -1, -announce)) if announce else ()
    results = []
    for way in (_by_calls, _by_place):
        table, acc = _table(policy, 10, tenants)
        table.take_events()
        seen = []
        for nums in steps:
            keys = [_key(i) for i in nums]
            ok = way(table, keys, clean, order)
            # a refused victim: the calls put it back into the policy (LRU: at its cold end,
            # not where it was), place never takes it out: the same but for the order
            seen.append((ok, _snapshot(table, acc, order=ok)))
            table.check()
            if acc is not None:
                acc.check(table.keys)
            if not ok:
                break
            table.complete_load(keys, DEV)
        results.append(seen)
    assert results[0] == results[1]


def test_a_placement_that_would_wait_changes_nothing() -> None:
    table, _ = _table("lru", 4, False)
    first = [_key(i) for i in range(4)]
    got = table.place(first, DEV, HOST, loadable=lambda n: True, clean=lambda k: True)
    assert isinstance(got, Placement) and got.new == first and got.dropped == 0
    table.land(got, DEV, HOST)
    table.complete_load(first, DEV)
    table.take_events()
    before = _snapshot(table, None, order=False)  # (the pins undone record a use, as before)
    cases: list[tuple[list[bytes], Callable[[int], bool], Callable[[list[bytes]], bool]]] = [
        ([_key(0), _key(9)], lambda n: False, lambda k: True),  # the copy would not run now
        ([_key(0), _key(9)], lambda n: True, lambda k: False),  # its victim needs a write-back
        ([_key(0), _key(50)], lambda n: True, lambda k: True),  # in no tier
    ]
    for keys, loadable, clean in cases:
        assert table.place(keys, DEV, HOST, loadable=loadable, clean=clean) is None
        assert _snapshot(table, None, order=False) == before
        table.check()
    full = _snapshot(table, None)
    for order in ((), tuple(reversed(first))):  # a refused victim stays where it was
        got = table.place(
            [_key(9)], DEV, HOST, loadable=lambda n: True, clean=lambda k: False, keep_order=order
        )
        assert got is None
        assert _snapshot(table, None) == full
    pinned = table.place(first, DEV, HOST, loadable=lambda n: True, clean=lambda k: True)
    assert pinned is not None and pinned.pinned == first  # every slot pinned now: no room
    table.take_events()
    before = _snapshot(table, None, order=False)
    assert table.place([_key(9)], DEV, HOST, loadable=lambda n: True, clean=lambda k: True) is None
    assert _snapshot(table, None, order=False) == before
    table.land(pinned, DEV, HOST)  # (nothing new: nothing to land)
    table.complete_load(first, DEV)
    table.check()


def test_a_placement_that_fails_is_undone_whole() -> None:
    table, _ = _table("lru", 4, False)
    table.take_events()
    keys = [_key(i) for i in range(3)]
    got = table.place(keys[:1], DEV, HOST, loadable=lambda n: True, clean=lambda k: True)
    assert got is not None
    table.land(got, DEV, HOST)
    table.complete_load(keys[:1], DEV)
    table.take_events()
    before = _snapshot(table, None, order=False)
    got = table.place(keys, DEV, HOST, loadable=lambda n: True, clean=lambda k: True)
    assert got is not None and got.pinned == keys[:1] and got.new == keys[1:]
    assert table.pins(_key(1), HOST) == 1  # the sources pinned for the copy
    table.land(got, DEV, HOST, ok=False)  # the copy failed: its pages go, every pin with them
    assert _snapshot(table, None, order=False) == before
    table.check()


def test_an_unknown_tier_is_a_typed_error() -> None:
    from tierkv.errors import UnknownPageError

    table, _ = _table("lru", 4, False)
    with pytest.raises(UnknownPageError):
        table.place([_key(0)], DEV, "cold", loadable=lambda n: True, clean=lambda k: True)
    assert table.pins(_key(0), HOST) == 0 and not table.keys(DEV)
