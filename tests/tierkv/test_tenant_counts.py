"""The tenants' per-batch count (tierkv/tenant_counts.py, tierkv/_tally.c): the C count and its
Python reference give the same results and leave the same lists, a bad index changes nothing,
and the counts the page table's hooks keep are the same whichever runs."""

from __future__ import annotations

import gc
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import tenant_counts
from tierkv.tenant_counts import NO_LIMIT, TierCounts, tally_py

NATIVE = tenant_counts.NATIVE
needs_native = pytest.mark.skipif(NATIVE is None, reason="tierkv._tally was not built")
TALLIES = [tally_py] + ([NATIVE] if NATIVE is not None else [])

batches = st.lists(st.integers(0, 9), max_size=80)  # key numbers; 0-6 charged below


def _of() -> dict[bytes, int]:
    return {f"k{j}".encode(): j % 3 for j in range(7)}  # k7.. are nobody's


@settings(max_examples=300, deadline=None)
@given(nums=batches, plus=st.booleans(), minus=st.booleans(), as_tuple=st.booleans())
def test_the_c_count_equals_the_python_reference(
    nums: list[int], plus: bool, minus: bool, as_tuple: bool
) -> None:
    keys: list[bytes] | tuple[bytes, ...] = [f"k{j}".encode() for j in nums]
    if as_tuple:
        keys = tuple(keys)
    got = []
    for f in TALLIES:
        p, m = [5, 5, 5, 5], [5, 5, 5, 5]
        r = f(_of(), keys, 3, p if plus else None, m if minus else None)
        got.append((r, p, m))
    assert all(g == got[0] for g in got)
    r, p, m = got[0]
    ids = [(j % 3 if j < 7 else 3) for j in nums]
    assert r == (ids[0] if ids and len(set(ids)) == 1 else -1)
    for i in range(4):
        assert p[i] == 5 + (ids.count(i) if plus else 0)
        assert m[i] == 5 - (ids.count(i) if minus else 0)


@pytest.mark.parametrize("f", TALLIES)
def test_a_bad_index_changes_nothing(f: object) -> None:
    of = {b"a": 0, b"b": 7, b"c": -1}
    for bad in ([b"a", b"b"], [b"c"], [b"a", b"zz"]):
        p, m = [1, 1], [1, 1]
        with pytest.raises(ValueError, match="out of range"):
            f(of, bad, 9, p, m)  # type: ignore[operator]
        assert (p, m) == ([1, 1], [1, 1])
    assert f(of, [], 1, [0, 0], None) == -1  # type: ignore[operator]


@needs_native
def test_the_c_count_refuses_wrong_types() -> None:
    assert NATIVE is not None
    with pytest.raises(TypeError):
        NATIVE([], [b"a"], 0, None, None)
    with pytest.raises(TypeError):
        NATIVE({}, 5, 0, None, None)
    with pytest.raises(TypeError):
        NATIVE({}, [b"a"], 0, (1,), None)
    with pytest.raises(TypeError):
        NATIVE({}, [b"a"], 0, None)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        NATIVE({b"a": "x"}, [b"a"], 0, [0], None)


def _run_hooks(
    monkeypatch: pytest.MonkeyPatch, f: object
) -> tuple[list[int], list[int], list[int]]:
    monkeypatch.setattr(tenant_counts, "tally", f)
    of = {b"a1": 0, b"a2": 0, b"b1": 1, b"b2": 1}
    caused = [0, 0]
    c = TierCounts(of, caused, [1, 0], [NO_LIMIT, NO_LIMIT])
    c.bind_slots(4)
    c.replaced([], [b"a1", b"a2", b"b1"])
    c.replaced([b"a1"], [b"b2"])  # b's page in a's room: caused by b
    c.evicted([b"a2", b"x"], 0, [2, 3])  # chosen for a's pages, MOVING
    c.put_back([b"a2"], [2])  # a2 came back: no longer caused by a
    c.left([b"b1"])
    c.replaced([b"a2", b"b2"], [b"a1", b"b1", b"b2"])  # mixed: a1 free, b1 and b2 evict
    assert c.shares([b"a1", b"b1"], 1) == [(1, 1)]
    assert c.shares([b"a1", b"b1"], 2) == [(0, 1), (1, 1)]
    assert c.shares([b"zz"], 2) == [(None, 2)]
    assert c.shares([b"a1"], 3) == [(0, 1), (None, 2)]
    return c.pages(), c.evictions(), caused


@needs_native
def test_the_hooks_keep_the_same_counts_with_either_count(monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as m:
        py = _run_hooks(m, tally_py)
    with monkeypatch.context() as m:
        c = _run_hooks(m, NATIVE)
    assert py == c
    assert py == ([1, 2], [2, 1], [1, 3])  # (worked by hand, step by step)


COUNTS = [tenant_counts.PyTierCounts] + (
    [TierCounts] if TierCounts is not tenant_counts.PyTierCounts else []
)
"""The counts' classes: the Python reference and (built) the C one."""

ops = st.lists(
    st.tuples(
        st.sampled_from(
            ["replaced", "evicted", "put_back", "left", "cause", "any_pick", "shares", "assign"]
        ),
        st.lists(st.integers(0, 9), max_size=12),  # keys (k7.. nobody's)
        st.lists(st.integers(0, 9), max_size=6),  # the victims of replaced (slots: assign)
        st.integers(-1, 14),  # n, or a tenant (-1: None)
    ),
    max_size=40,
)


def _drive(cls: type, script: list[tuple[str, list[int], list[int], int]]) -> list[object]:
    """Run ``script`` on a fresh counts of ``cls`` (3 tenants, tenant 0 with a reservation of
    2, tenant 2 a limit of 3): every result, error type and the counts after each step."""
    caused = [0, 0, 0]
    c = cls(_of(), caused, [2, 0, 0], [NO_LIMIT, NO_LIMIT, 3])
    c.bind_slots(10)
    seen: list[object] = [c.active, c.nobody]
    for op, a, b, x in script:
        keys = [f"k{j}".encode() for j in a]
        try:
            if op == "replaced":
                got: object = c.replaced([f"k{j}".encode() for j in b], keys)
            elif op == "evicted":  # (MOVING, in the slots of the keys' numbers, or gone)
                got = c.evicted(keys, None if x < 0 else x % 3, a if x % 2 else ())
            elif op == "put_back":
                got = c.put_back(keys, a)
            elif op == "left":
                got = c.left(keys)
            elif op == "cause":
                got = c.cause(keys, x)
            elif op == "any_pick":
                got = (c.any_pick(x), c.over_limit())
            elif op == "assign":  # (victims in the slots of b's numbers, room of x)
                got = c.assign(keys, x, b)
            else:
                got = c.shares(keys, x)
        except ValueError as e:  # (the reference's InvalidInputError is one)
            got = ("ValueError", str(e))
        seen.append((got, c.pages(), c.evictions(), list(caused)))
    return seen


@pytest.mark.skipif(len(COUNTS) < 2, reason="tierkv._tally was not built")
@settings(max_examples=400, deadline=None)
@given(script=ops)
def test_the_c_counts_equal_the_python_reference(
    script: list[tuple[str, list[int], list[int], int]],
) -> None:
    py, c = (_drive(cls, script) for cls in COUNTS)
    assert py == c


@pytest.mark.parametrize("cls", COUNTS)
def test_the_counts_refuse_a_bad_tenant_and_change_nothing(cls: type) -> None:
    caused = [0, 0]
    c = cls({b"a": 0, b"bad": 5}, caused, [1, 0], [NO_LIMIT, NO_LIMIT])
    c.bind_slots(2)
    c.replaced([], [b"a"])
    before = (c.pages(), c.evictions(), list(caused))
    for call in (
        lambda: c.evicted([b"a"], 7),  # a tenant past the counts
        lambda: c.evicted([b"a", b"bad"], 0),  # a charge past them
        lambda: c.replaced([b"a"], [b"bad"]),
        lambda: c.left([b"bad"]),
        lambda: c.put_back([b"a"], [9]),  # a slot past the tier's
        lambda: c.put_back([b"a"], [0, 1]),  # two slots for one page
        lambda: c.evicted([b"a"], 0, [2]),
        lambda: c.evicted([b"a"], 0, [0, 1]),
        lambda: c.assign([b"a"], 1, [0, 1]),  # more victims than the room
        lambda: c.assign([b"bad"], 1, [0]),  # a charge past the counts
        lambda: c.assign([b"a"], 1, [2]),  # a slot past the tier's
        lambda: c.assign([b"a"], -1, []),
    ):
        with pytest.raises(ValueError):
            call()
        assert (c.pages(), c.evictions(), list(caused)) == before
    with pytest.raises(ValueError):
        cls({}, [0], [1, 0], [NO_LIMIT, NO_LIMIT])  # caused for one tenant of two
    with pytest.raises(ValueError):
        cls({}, [0, 0], [1, 0], [NO_LIMIT])  # one limit for two


def test_counts_objects_are_freed_and_keep_their_type() -> None:
    """Regression: the C type's dealloc dropped a reference to the (heap) subclass on top of
    the one ``subtype_dealloc`` drops, so each freed TierCounts took one of the class's
    references and the interpreter crashed in its final collection."""
    before = sys.getrefcount(TierCounts)
    for _ in range(200):
        c = TierCounts({b"a": 0}, [0], [1], [NO_LIMIT])
        c.replaced([], [b"a"])
        del c
    gc.collect()
    assert sys.getrefcount(TierCounts) == before


@needs_native
def test_a_c_counts_never_initialized_raises_rather_than_crashes() -> None:
    from tierkv._tally import Counts

    c = Counts.__new__(Counts)
    for call in (
        lambda: c.cause([b"a"], 1),
        lambda: c.evicted([b"a"], None),
        lambda: c.replaced([], [b"a"]),
        lambda: c.put_back([b"a"], [0]),
        lambda: c.left([b"a"]),
    ):
        with pytest.raises(TypeError, match="__init__"):
            call()
    assert c.pages() == [] and c.any_pick(1) and not c.active
