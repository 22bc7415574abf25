import sys
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tierkv import PageState, PageStateError, PageTable, UnknownPageError
from tierkv.errors import PinError, TierKVError
from tierkv.policies import POLICIES, LRUPolicy

sys.path.insert(0, str(Path(__file__).parent))
from policy_refs import KeyPolicy, RefLRU


def stored(table: PageTable, keys: list[Any], tier: str = "host") -> None:
    alloc = table.prepare_store(keys, tier)
    assert alloc is not None
    table.complete_store(alloc.keys, tier)


def snapshot(table: PageTable) -> dict[str, dict[Any, tuple[int, int, int]]]:
    return {
        t: {k: (table.state(k, t), table.pins(k, t), table.slot(k, t)) for k in table.keys(t)}
        for t in table.tier_names
    }


def test_two_phase_store_and_load() -> None:
    t = PageTable({"device": 2, "host": 4})
    alloc = t.prepare_store(["a", "b", "c"], "host")
    assert alloc is not None and alloc.keys == ["a", "b", "c"] and len(set(alloc.slots)) == 3
    assert t.lookup(["a"], "host") == 0  # still being written
    t.complete_store(["a", "b", "c"], "host")
    assert t.lookup(["a", "b", "x", "c"], "host") == 2
    assert t.lookup(["a", "b", "c"], "device") == 0
    assert t.lookup_tiers(["a", "b"]) == {"device": 0, "host": 2}
    slots = t.prepare_load(["a", "b"], "host")
    assert slots == [t.slot("a", "host"), t.slot("b", "host")]
    assert t.pins("a", "host") == 1
    t.complete_load(["a", "b"], "host")
    assert t.pins("a", "host") == 0
    assert [e.kind for e in t.take_events()] == ["stored"]
    assert t.take_events() == []
    t.check()


def test_prepare_load_with_duplicate_keys_pins_twice() -> None:
    t = PageTable({"host": 2})
    stored(t, ["a", "b"])
    t.prepare_load(["a", "a"], "host")
    assert t.pins("a", "host") == 2 and t.evictable("host") == 1
    t.complete_load(["a"], "host")
    assert t.pins("a", "host") == 1 and t.evictable("host") == 1
    with pytest.raises(PinError):  # a is pinned once, not twice: nothing changes
        t.complete_load(["a", "a"], "host")
    assert t.pins("a", "host") == 1
    t.complete_load(["a"], "host")
    assert t.pins("a", "host") == 0 and t.evictable("host") == 2
    t.check()


def test_lookup_any_tier() -> None:
    t = PageTable({"device": 2, "host": 4})
    stored(t, ["a"], "device")
    stored(t, ["b"], "host")
    assert t.lookup(["a", "b", "c"]) == 2
    assert t.tiers_of("a") == ["device"]


def test_eviction_by_lru_skips_pinned_and_reports() -> None:
    t = PageTable({"host": 3}, "lru")
    stored(t, ["a", "b", "c"])
    t.prepare_load(["a"], "host")  # pinned: never evicted
    alloc = t.prepare_store(["d"], "host")
    assert alloc is not None and alloc.evicted == ["b"]
    t.complete_store(["d"], "host")
    t.touch(["c"], "host")
    alloc = t.prepare_store(["e"], "host")
    assert alloc is not None and alloc.evicted == ["d"]
    t.complete_store(["e"], "host")
    evs = t.take_events()
    assert [(e.kind, e.keys) for e in evs if e.kind == "evicted"] == [
        ("evicted", ("b",)),
        ("evicted", ("d",)),
    ]
    t.check()


def test_full_of_pinned_returns_none_and_changes_nothing() -> None:
    t = PageTable({"host": 2})
    stored(t, ["a", "b"])
    t.prepare_load(["a", "b"], "host")
    before = snapshot(t)
    assert t.prepare_store(["c"], "host") is None
    assert snapshot(t) == before
    t.complete_load(["a"], "host")
    assert t.prepare_store(["c", "d"], "host") is None  # room for one only
    alloc = t.prepare_store(["c"], "host")
    assert alloc is not None and alloc.evicted == ["a"]
    t.check()


def test_store_never_evicts_its_own_batch() -> None:
    t = PageTable({"host": 3})
    stored(t, ["a", "b", "c"])
    alloc = t.prepare_store(["a", "b", "d"], "host")  # a, b present: only c may go
    assert alloc is not None and alloc.present == ["a", "b"] and alloc.evicted == ["c"]
    t.complete_store(alloc.keys, "host")
    assert t.prepare_store(["a", "b", "d", "e"], "host") is None
    t.check()


def test_rollback_frees_slots() -> None:
    t = PageTable({"host": 2})
    alloc = t.prepare_store(["a", "b"], "host")
    assert alloc is not None
    t.complete_store(["a", "b"], "host", ok=False)
    assert t.used("host") == 0
    assert t.take_events() == []
    t.check()


def test_write_back_moves() -> None:
    t = PageTable({"device": 2, "host": 4})
    stored(t, ["a", "b"], "device")
    t.touch(["a"], "device")
    victims = t.prepare_evict("device", 1)
    assert [k for k, _ in victims] == ["b"]
    assert t.state("b", "device") is PageState.MOVING
    assert t.lookup(["b"], "device") == 0
    with pytest.raises(PageStateError):
        t.prepare_load(["b"], "device")
    stored(t, ["b"], "host")
    t.complete_evict(["b"], "device")
    assert t.tiers_of("b") == ["host"]
    victims = t.prepare_evict("device", 5)
    assert [k for k, _ in victims] == ["a"]
    t.complete_evict(["a"], "device", ok=False)
    assert t.state("a", "device") is PageState.READABLE
    t.check()


def test_misuse_raises_typed_errors_and_changes_nothing() -> None:
    t = PageTable({"host": 4})
    stored(t, ["a", "b"])
    t.prepare_store(["w"], "host")
    cases: list[tuple[type[Exception], Any]] = [
        (UnknownPageError, lambda: t.prepare_load(["a", "zz"], "host")),
        (UnknownPageError, lambda: t.complete_load(["zz"], "host")),
        (UnknownPageError, lambda: t.touch(["a"], "nowhere")),
        (UnknownPageError, lambda: t.complete_store(["w", "zz"], "host")),
        (UnknownPageError, lambda: t.lookup(["a"], "nowhere")),
        (PinError, lambda: t.complete_load(["a"], "host")),
        (ValueError, lambda: t.prepare_evict("host", -1)),
        (ValueError, lambda: t.candidates("host", -1)),
        (PageStateError, lambda: t.prepare_load(["a", "w"], "host")),
        (PageStateError, lambda: t.complete_evict(["a"], "host")),
        (PageStateError, lambda: t.remove(["a", "w"], "host")),
        (PageStateError, lambda: t.rekey(["a", "a"], ["x", "y"], "host")),  # a key repeats
        (PageStateError, lambda: t.rekey(["a", "b"], ["x", "x"], "host")),
        (PageStateError, lambda: t.rekey(["a"], ["b"], "host")),  # already there
        (UnknownPageError, lambda: t.state("zz", "host")),
    ]
    for exc, call in cases:
        before = snapshot(t)
        with pytest.raises(exc):
            call()
        assert snapshot(t) == before, exc
    t.prepare_load(["a"], "host")
    with pytest.raises(PinError):
        t.complete_load(["a", "a"], "host")
    with pytest.raises(PageStateError):
        t.remove(["a"], "host")
    assert t.pins("a", "host") == 1
    t.check()


def test_constructor_errors() -> None:
    with pytest.raises(ValueError):
        PageTable({})
    with pytest.raises(ValueError):
        PageTable({"host": -1})
    with pytest.raises(ValueError):
        PageTable({"host": 1}, "nope")


KEYS = st.lists(st.integers(0, 11), min_size=1, max_size=5)


class PageTableMachine(RuleBasedStateMachine):
    """The page table against a plain model: {tier: {key: [state, pins]}}."""

    def __init__(self) -> None:
        super().__init__()
        self.caps = {"device": 3, "host": 5}
        self.table = PageTable(self.caps, "lru")
        self.model: dict[str, dict[int, list[int]]] = {"device": {}, "host": {}}

    def _same(self) -> None:
        for tier, pages in self.model.items():
            assert set(self.table.keys(tier)) == set(pages)
            for k, (state, pins) in pages.items():
                assert self.table.state(k, tier) == state
                assert self.table.pins(k, tier) == pins

    def _expect_error(self, call: Any) -> None:
        before = snapshot(self.table)
        with pytest.raises(Exception) as info:
            call()
        assert isinstance(info.value, (UnknownPageError, PageStateError, PinError))
        assert snapshot(self.table) == before

    @rule(tier=st.sampled_from(["device", "host"]), keys=KEYS)
    def prepare_store(self, tier: str, keys: list[int]) -> None:
        pages = self.model[tier]
        batch = list(dict.fromkeys(keys))
        new = [k for k in batch if k not in pages]
        evictable = [
            k
            for k, (s, p) in pages.items()
            if s == PageState.READABLE and p == 0 and k not in batch
        ]
        need = len(new) - (self.caps[tier] - len(pages))
        alloc = self.table.prepare_store(keys, tier)
        if need > len(evictable):
            assert alloc is None
            return
        assert alloc is not None
        assert alloc.keys == new and alloc.present == [k for k in batch if k in pages]
        assert len(alloc.evicted) == max(0, need)
        for v in alloc.evicted:
            assert v in evictable
            del pages[v]
        for k in new:
            pages[k] = [PageState.WRITING, 0]

    @rule(tier=st.sampled_from(["device", "host"]), ok=st.booleans(), data=st.data())
    def complete_store(self, tier: str, ok: bool, data: st.DataObject) -> None:
        pages = self.model[tier]
        keys = data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=3))
        if all(k in pages and pages[k][0] != PageState.MOVING for k in keys):
            self.table.complete_store(keys, tier, ok)
            for k in dict.fromkeys(keys):  # READABLE ones are passed over; repeats count once
                if pages[k][0] != PageState.WRITING:
                    continue
                if ok:
                    pages[k][0] = PageState.READABLE
                else:
                    del pages[k]
        else:
            self._expect_error(lambda: self.table.complete_store(keys, tier, ok))

    @rule(tier=st.sampled_from(["device", "host"]), keys=KEYS)
    def prepare_load(self, tier: str, keys: list[int]) -> None:
        pages = self.model[tier]
        if all(k in pages and pages[k][0] == PageState.READABLE for k in keys):
            self.table.prepare_load(keys, tier)
            for k in keys:
                pages[k][1] += 1
        else:
            self._expect_error(lambda: self.table.prepare_load(keys, tier))

    @rule(tier=st.sampled_from(["device", "host"]), keys=KEYS)
    def complete_load(self, tier: str, keys: list[int]) -> None:
        pages = self.model[tier]
        ok = all(k in pages and pages[k][1] >= keys.count(k) for k in keys)
        if ok:
            self.table.complete_load(keys, tier)
            for k in keys:
                pages[k][1] -= 1
        else:
            self._expect_error(lambda: self.table.complete_load(keys, tier))

    @rule(tier=st.sampled_from(["device", "host"]), n=st.integers(0, 3))
    def prepare_evict(self, tier: str, n: int) -> None:
        pages = self.model[tier]
        evictable = {k for k, (s, p) in pages.items() if s == PageState.READABLE and p == 0}
        out = self.table.prepare_evict(tier, n)
        assert len(out) == min(n, len(evictable))
        for k, _slot in out:
            assert k in evictable
            pages[k][0] = PageState.MOVING

    @rule(tier=st.sampled_from(["device", "host"]), ok=st.booleans())
    def complete_evict(self, tier: str, ok: bool) -> None:
        pages = self.model[tier]
        moving = [k for k, (s, _) in pages.items() if s == PageState.MOVING]
        if not moving:
            self._expect_error(lambda: self.table.complete_evict([99], tier, ok))
            return
        self.table.complete_evict(moving, tier, ok)
        for k in moving:
            if ok:
                del pages[k]
            else:
                pages[k][0] = PageState.READABLE

    @rule(tier=st.sampled_from(["device", "host"]), keys=KEYS)
    def lookup_and_touch(self, tier: str, keys: list[int]) -> None:
        pages = self.model[tier]
        n = 0
        for k in keys:
            if k not in pages or pages[k][0] != PageState.READABLE:
                break
            n += 1
        assert self.table.lookup(keys, tier) == n
        self.table.touch(keys, tier)  # keys the tier does not hold are passed over

    @precondition(lambda self: any(self.model.values()))
    @rule(tier=st.sampled_from(["device", "host"]), keys=KEYS)
    def remove(self, tier: str, keys: list[int]) -> None:
        pages = self.model[tier]
        ok = len(set(keys)) == len(keys) and all(
            k in pages and pages[k] == [PageState.READABLE, 0] for k in keys
        )
        if ok:
            self.table.remove(keys, tier)
            for k in keys:
                del pages[k]
        else:
            self._expect_error(lambda: self.table.remove(keys, tier))

    @invariant()
    def consistent(self) -> None:
        self.table.check()
        self._same()
        for tier, cap in self.caps.items():
            assert self.table.used(tier) <= cap


TestPageTableMachine = PageTableMachine.TestCase
TestPageTableMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def key_lru() -> KeyPolicy:
    """LRU on keys (``policy_refs.RefLRU``), bound through ``KeyPolicy``: the reference."""
    return KeyPolicy(RefLRU(), "lru-keys")


class LFUPageTableMachine(PageTableMachine):
    """The same machine over another policy (LFU: several queues, a history)."""

    def __init__(self) -> None:
        super().__init__()
        self.table = PageTable(self.caps, "lfu")


TestLFUPageTableMachine = LFUPageTableMachine.TestCase
TestLFUPageTableMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)

OPS = st.lists(
    st.tuples(
        st.sampled_from(["store", "load", "unpin", "touch", "evict", "undo", "remove", "rekey"]),
        st.lists(st.integers(0, 15), min_size=1, max_size=6),
        st.booleans(),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_slot_lru_evicts_exactly_as_key_lru(ops: list[tuple[str, list[int], bool]]) -> None:
    """Every victim of LRU equals the key-based reference LRU's, op for op."""
    with patch.dict(POLICIES, {"lru-keys": key_lru}):
        tables = [PageTable({"host": 6}, "lru"), PageTable({"host": 6}, "lru-keys")]
    renamed = 100
    for op, keys, ok in ops:
        results = []
        for t in tables:
            try:
                if op == "store":
                    a = t.prepare_store(keys, "host")
                    if a is not None:
                        t.complete_store(a.keys, "host", ok)
                    res: Any = a and (a.keys, a.evicted, a.present)
                elif op == "load":
                    res = t.prepare_load(keys, "host")
                elif op == "unpin":
                    res = t.complete_load(keys, "host")
                elif op == "touch":
                    res = t.touch(keys, "host")
                elif op == "evict":
                    res = [k for k, _ in t.prepare_evict("host", len(keys))]
                elif op == "undo":
                    moving = [k for k in t.keys("host") if t.state(k, "host") == PageState.MOVING]
                    res = t.complete_evict(moving, "host", ok) if moving else None
                elif op == "remove":
                    res = t.remove(keys, "host")
                else:
                    res = t.rekey(keys, list(range(renamed, renamed + len(keys))), "host")
            except (UnknownPageError, PageStateError, PinError) as exc:
                res = type(exc)
            t.check()
            results.append(res)
        renamed += len(keys)
        assert results[0] == results[1], op
        assert snapshot(tables[0]) == snapshot(tables[1])
    slot_lru, ref_lru = (t.policy("host") for t in tables)
    assert isinstance(slot_lru, LRUPolicy) and isinstance(ref_lru, KeyPolicy)
    assert len(slot_lru) == len(ref_lru)
    assert all((k in slot_lru) == (k in ref_lru) for k in range(renamed))


def test_bound_lru_refuses_a_second_binding_and_touch_slots_handles_repeats() -> None:
    p = LRUPolicy()
    p.bind_slots(4, {})
    with pytest.raises(TierKVError):
        p.bind_slots(4, {})
    p.insert_slots([0, 1, 2, 3], (), None)
    p.touch_slots([1, 0, 1, 3, 3], ())  # order now 2, 0, 1, 3
    assert p.evict_slots(2, None) == [2, 0]
    assert p.evict_slots(5, lambda s: s != 1) == [3]  # 1 skipped: to the recent end
    assert len(p) == 1 and p.evict_slots(1, None) == [1] and len(p) == 0


@pytest.mark.parametrize("policy", ["lru", "kvaware"])
def test_the_table_holds_its_pages_in_containers_the_collector_does_not_walk(policy: str) -> None:
    """Issue 17: a full collector pass walked every per-slot list item of every tier (~10 ms
    for 10,000 idle sequences once the items were distinct keys); the table (and kvaware's
    slot -> key tables) now keep them in arrays and dicts of atomic keys, which the collector
    neither tracks nor walks."""
    import gc

    t = PageTable({"device": 64, "host": 256}, policy=policy)
    keys = [bytes([i]) * 18 for i in range(200)]
    assert t.prepare_store(keys, "host") is not None  # (the allocation is let go)
    t.complete_store(keys, "host")
    t.prepare_load(keys[:10], "host")
    gc.collect()
    tracked = [r for r in gc.get_referrers(keys[7]) if r is not keys]
    assert tracked == [], [type(r).__name__ for r in tracked]


def test_a_capacity_past_max_pages_is_refused_at_once() -> None:
    """PageTable({"t": 10**12}) allocated per-slot state for 10^12 pages (the OOM killer);
    now InvalidInputError before anything is allocated."""
    from tierkv.errors import InvalidInputError
    from tierkv.page_table import MAX_PAGES

    with pytest.raises(InvalidInputError, match="capacity"):
        PageTable({"t": 10**12})
    with pytest.raises(InvalidInputError, match="capacity"):
        PageTable({"t": MAX_PAGES + 1})
    with pytest.raises(InvalidInputError, match="a dict"):  # (InvalidTypeError)
        PageTable([("t", 4)])  # type: ignore[arg-type]  (an AttributeError before)
