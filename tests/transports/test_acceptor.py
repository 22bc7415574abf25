"""The accept loop's admission by address (guard.Gate) and its tarpit (acceptor.Acceptor)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.transports.acceptor import Acceptor, listen
from tierkv.transports.guard import Audit, Gate

DEADLINE = 5.0


def gate(**kw: int | None) -> Gate:
    opts: dict[str, int | None] = {"per_peer": 4, "preauth_per_peer": 2, "preauth_total": 3}
    opts.update(kw)
    return Gate(**opts)  # type: ignore[arg-type]


def test_gate_names_the_budget_that_refuses() -> None:
    g = gate()
    assert g.admit("a") is None and g.admit("a") is None
    assert g.admit("a") == "preauth_per_peer"
    g.authenticated("a")
    g.authenticated("a")
    assert g.admit("a") is None and g.admit("a") is None
    assert g.admit("a") == "connections_per_peer"  # 4 open from "a"
    assert g.admit("b") is None
    assert g.admit("c") == "preauth_total"  # a, a, b still at the handshake
    g.closed("b", authenticated=False)
    assert g.admit("c") is None


def test_failures_past_the_budget_refuse_an_address_until_forgiven() -> None:
    g = gate(failures=3)
    g.forgiven_per_s = 0.0  # nothing forgiven during the test: the outcome cannot race
    for _ in range(3):
        assert g.admit("a") is None
        g.closed("a", authenticated=False)
        g.failed("a")
    assert g.admit("a") == "penalty"
    assert g.admit("b") is None  # other addresses are not touched
    assert g.penalized("a") and not g.penalized("b")


def test_no_penalty_when_off() -> None:
    g = gate(failures=None)
    for _ in range(100):
        g.failed("a")
    assert not g.penalized("a")


def test_the_strike_table_is_bounded() -> None:
    g = gate(failures=1, max_tracked=2)
    g.forgiven_per_s = 0.0
    for a in ("a", "b", "c"):
        g.failed(a)
    assert not g.penalized("a")  # the oldest was forgotten to make room
    assert g.penalized("b") and g.penalized("c")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["admit", "auth", "close", "fail"]), st.sampled_from("abc")))
)
def test_gate_counts_stay_consistent(ops: list[tuple[str, str]]) -> None:
    """Random admits, handshakes and closes: the counts never go negative or past a cap, and
    closing everything admitted returns the gate to empty."""
    g = gate()
    open_: dict[str, list[bool]] = {}  # per address: authenticated flags of open connections
    for op, a in ops:
        if op == "admit" and g.admit(a) is None:
            open_.setdefault(a, []).append(False)
        elif op == "auth" and False in open_.get(a, []):
            open_[a][open_[a].index(False)] = True
            g.authenticated(a)
        elif op == "close" and open_.get(a):
            g.closed(a, authenticated=open_[a].pop())
        elif op == "fail":
            g.failed(a)
        preauth = sum(not f for fs in open_.values() for f in fs)
        assert g.preauth_now == preauth <= g.preauth_total
    for a, flags in open_.items():
        for f in flags:
            g.closed(a, authenticated=f)
    assert g.preauth_now == 0


@asynccontextmanager
async def acceptor(g: Gate, *, hold_s: float, max_held: int) -> AsyncIterator[Acceptor]:
    admitted: list[socket.socket] = []
    acc = Acceptor(
        listen("127.0.0.1", 0),
        g,
        lambda s, a: admitted.append(s),
        Audit("test"),
        hold_s=hold_s,
        max_held=max_held,
    )
    acc.start()
    try:
        yield acc
    finally:
        acc.close()
        for s in admitted:
            s.close()


async def _until(cond: Callable[[], bool]) -> None:
    """Wait (bounded) for ``cond()``; the accept loop runs meanwhile."""
    for _ in range(int(DEADLINE / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within the deadline")


async def _reset(r: asyncio.StreamReader) -> None:
    """The connection ends with a reset (not a FIN, not silence) within the deadline."""
    async with asyncio.timeout(DEADLINE):
        try:
            data = await r.read()
        except ConnectionResetError:
            return
    raise AssertionError(f"closed without a reset ({len(data)} bytes read)")


async def _connect_reset(port: int) -> None:
    """A new connection is reset (while connecting, or right after) within the deadline."""
    try:
        r, w = await asyncio.wait_for(_connect(port), DEADLINE)
    except ConnectionResetError:
        return  # the reset came before the connect completed here
    try:
        await _reset(r)
    finally:
        w.close()


async def _connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def test_refused_connections_are_held_unread_then_reset() -> None:
    g = gate(failures=1)
    g.forgiven_per_s = 0.0
    g.failed("127.0.0.1")  # penalized from the start
    async with acceptor(g, hold_s=0.3, max_held=8) as acc:
        r, w = await _connect(acc.port)
        await _until(lambda: acc.held == 1)
        assert acc.refused == 1 and acc.audit.by_reason["budget_hit:penalty"] == 1
        w.write(b"x" * 65536)  # never read
        await _reset(r)
        assert acc.held == 0
        w.close()


async def test_past_max_held_a_refused_connection_is_reset_at_once() -> None:
    g = gate(failures=1)
    g.forgiven_per_s = 0.0
    g.failed("127.0.0.1")
    async with acceptor(g, hold_s=60.0, max_held=1) as acc:
        first = await _connect(acc.port)
        await _until(lambda: acc.held == 1)
        await _connect_reset(acc.port)
        assert acc.held == 1 and acc.refused == 2
        first[1].close()


async def test_close_resets_held_connections_and_stops_listening() -> None:
    g = gate(failures=1)
    g.forgiven_per_s = 0.0
    g.failed("127.0.0.1")
    async with acceptor(g, hold_s=60.0, max_held=8) as acc:
        r, w = await _connect(acc.port)
        await _until(lambda: acc.held == 1)
        port = acc.port
        acc.close()
        assert acc.held == 0
        await _reset(r)
        w.close()
        with pytest.raises(OSError):
            await _connect(port)


async def test_admitted_connections_go_to_the_owner() -> None:
    g = gate()
    async with acceptor(g, hold_s=1.0, max_held=8) as acc:
        _, w = await _connect(acc.port)
        await _until(lambda: g.preauth_now == 1)
        assert acc.refused == 0 and acc.held == 0
        w.close()
