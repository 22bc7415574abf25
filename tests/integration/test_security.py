"""The page server and its clients against hostile peers (issue 14): relayed and replayed
handshakes, servers that cannot prove the secret, client-chosen peer links, pre-auth floods,
cancelled requests, broken connections and hostile replies."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tierkv import KVSpec
from tierkv.errors import InvalidInputError
from tierkv.remote import PageServer, RemoteCluster, RemoteTier
from tierkv.remote.errors import (
    PeerGoneError,
    RemoteError,
    RemoteProtocolError,
    RemoteRefusedError,
)
from tierkv.remote.protocol.control import Control
from tierkv.remote.protocol.wire import spec_fields
from tierkv.remote.sources.watch import Watch
from tierkv.store import KVStore
from tierkv.transports.session import HELLO_MAX, PREFIX, StreamSession

sys.path.insert(0, str(Path(__file__).parent))
from relay import relay

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
SECRET = b"security-test"
TIMEOUT = 3.0
KEYS = [bytes([i]) * 32 for i in range(1, 5)]


@contextlib.asynccontextmanager
async def page_server(**kw: Any) -> AsyncIterator[PageServer]:
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=32 * PAGE, codec=None)
    async with store, PageServer(store, secret=SECRET, timeout=TIMEOUT, **kw) as srv:
        yield srv


def peer(address: str, **kw: Any) -> RemoteTier:
    return RemoteTier(address, secret=SECRET, spec=SPEC, timeout=TIMEOUT, **kw)


async def test_a_relayed_session_gives_the_relay_nothing() -> None:
    """The relay passes the handshake through (so the client and server authenticate each
    other), but every frame it injects fails its tag: the server drops the connection and
    nothing is reserved."""
    async with page_server() as srv, relay(srv) as (address, state), peer(address) as client:
        assert await client.lookup(KEYS) == 0  # honest traffic passes through
        forged = b"\x83\xa2op\xa7reserve\xa2id\x63\xa4keys\x91\xc4\x20" + KEYS[0]
        state["writer"].write(PREFIX.pack(len(forged) + 16) + forged + bytes(16))
        await state["writer"].drain()
        for _ in range(100):
            if srv.stats()["protocol_error_total"]:
                break
            await asyncio.sleep(0.02)
        assert srv.stats()["protocol_error_total"] == 1
        assert srv.stats()["leases"] == 0
        # the connection is gone: the client reconnects (through the relay, which is as
        # harmless as a router) on its next call, or says it is gone
        with contextlib.suppress(RemoteError):
            await client.lookup(KEYS)
        assert await client.lookup(KEYS) == 0
        assert client.reconnects == 1


async def test_a_replayed_handshake_is_refused() -> None:
    async with page_server() as srv, relay(srv) as (address, state):
        async with peer(address) as client:
            await client.lookup(KEYS)
        auth = state["up"][0]  # the client's auth frame, proof included
        reader, writer = await asyncio.open_connection(srv.host, srv.port)
        session = StreamSession(reader, writer, srv_limits())
        assert (await session.recv())["op"] == "challenge"  # type: ignore[index]
        writer.write(auth)
        reply = await session.recv()
        assert reply is not None and reply["err"] == "auth"
        assert await session.recv() is None
        writer.close()
        assert srv.stats()["auth_refused_total"] == 1


def srv_limits() -> Any:
    from tierkv.remote.protocol.wire import REPLY_LIMITS

    return REPLY_LIMITS


async def test_a_server_that_cannot_prove_the_secret_is_refused() -> None:
    """A fake page server (no secret) that accepts any client: the client refuses it."""

    async def impostor(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        s = StreamSession(r, w, srv_limits())
        await s.send(
            {"op": "challenge", "v": 3, "role": "page-server", "id": "x", "nonce": b"n" * 16}
        )
        await s.recv()
        await s.send({"op": "welcome", "mac": bytes(32)})
        await asyncio.sleep(1)
        w.close()

    server = await asyncio.start_server(impostor, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(RemoteRefusedError, match="did not prove"):
            await peer(f"127.0.0.1:{port}").connect()
    finally:
        server.close()


async def test_a_wrong_secret_is_refused_and_counted() -> None:
    async with page_server() as srv:
        with pytest.raises(RemoteRefusedError, match="auth"):
            await RemoteTier(srv.address, secret=b"wrong", spec=SPEC, timeout=TIMEOUT).connect()
        assert srv.stats()["auth_refused_total"] == 1


async def test_hold_is_no_longer_an_op_and_the_server_dials_nobody() -> None:
    """The gossip's ``hold`` (a peer's holdings; issue 30 retired it for the Redis directory)
    is an unknown op: refused, nothing stored, nothing dialled, whoever sends it."""
    dialled: list[str] = []

    async def victim(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        dialled.append("x")
        w.close()

    bait = await asyncio.start_server(victim, "127.0.0.1", 0)
    bait_addr = f"127.0.0.1:{bait.sockets[0].getsockname()[1]}"
    try:
        async with page_server() as srv:
            for role in ("client", "page-server"):
                ctl = Control(srv.address, secret=SECRET, timeout=TIMEOUT, role=role, ident="x")
                await ctl.open()
                try:
                    with pytest.raises(RemoteError, match="unknown op"):
                        await ctl.call("hold", node=bait_addr, add=[KEYS[0]], drop=[])
                    assert (await ctl.call("locate", keys=[KEYS[0]]))["nodes"] == []
                finally:
                    await ctl.aclose()
            await asyncio.sleep(0.1)
            assert not dialled and srv.stats()["pages"] == 0
    finally:
        bait.close()


async def test_pre_auth_flood_is_bounded_and_a_client_still_gets_through() -> None:
    """100 connections sending oversized and garbage hellos are dropped at once (counted);
    an authenticated client is served meanwhile."""
    async with page_server() as srv, peer(srv.address) as client:
        base = srv.stats()

        async def flood(i: int) -> None:
            with contextlib.suppress(OSError):
                r, w = await asyncio.open_connection(srv.host, srv.port)
                blob = PREFIX.pack(8 << 20 if i % 2 else HELLO_MAX) + bytes(HELLO_MAX)
                w.write(blob)
                with contextlib.suppress(ConnectionError):
                    await w.drain()
                    await asyncio.wait_for(r.read(), TIMEOUT)
                w.close()

        flood_tasks = [asyncio.create_task(flood(i)) for i in range(100)]
        for _ in range(20):
            assert await client.lookup(KEYS) == 0
        await asyncio.gather(*flood_tasks)
        st = srv.stats()
        errors = st["protocol_error_total"] + st["budget_hit_total"]
        assert errors - base["protocol_error_total"] - base["budget_hit_total"] == 100
        assert srv.control.sessions == 1  # only the client's


async def test_an_address_whose_handshakes_keep_failing_is_refused_at_accept() -> None:
    """Past ``max_preauth_failures`` failed handshakes, an address's new connections get no
    challenge (nothing is read or sent), are held, then reset; other addresses and sessions
    already authenticated are served as before."""
    async with (
        page_server(max_preauth_failures=3, refused_hold=0.2) as srv,
        peer(srv.address) as client,  # from 127.0.0.1
    ):
        for _ in range(3):  # from 127.0.0.2: garbage hellos, each a failure
            r, w = await asyncio.open_connection(srv.host, srv.port, local_addr=("127.0.0.2", 0))
            w.write(PREFIX.pack(8 << 20) + bytes(64))
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(r.read(), TIMEOUT)
            w.close()
        for _ in range(100):
            if srv.gate.penalized("127.0.0.2"):
                break
            await asyncio.sleep(0.02)
        assert srv.gate.penalized("127.0.0.2") and not srv.gate.penalized("127.0.0.1")
        sessions = srv.control.sessions
        r, w = await asyncio.open_connection(srv.host, srv.port, local_addr=("127.0.0.2", 0))
        with pytest.raises(ConnectionResetError):  # no challenge: held, then reset
            got = await asyncio.wait_for(r.read(), TIMEOUT)
            raise AssertionError(f"not reset: {got[:16]!r}")
        w.close()
        assert srv.control.sessions == sessions  # no session was made for it
        assert srv.audit.by_reason["budget_hit:penalty"] == 1
        assert await client.lookup(KEYS) == 0  # the other address is served
        async with peer(srv.address) as other:  # and can still connect
            assert await other.lookup(KEYS) == 0


@pytest.mark.parametrize("caps", [{"max_preauth_per_peer": 4}, {"max_preauth": 4}])
async def test_silent_connections_are_capped(caps: dict[str, int]) -> None:
    """Per peer address and in all: the 5th and 6th silent connections are closed at once."""
    async with page_server(**caps) as srv:
        socks = [socket.create_connection((srv.host, srv.port)) for _ in range(6)]
        for _ in range(100):
            if srv.stats()["budget_hit_total"] >= 2:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.05)
        assert srv.stats()["budget_hit_total"] == 2  # the 5th and 6th were closed at once
        for s in socks:
            s.close()


async def _cancel_soon(call: Awaitable[Any]) -> None:
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, RemoteError):
        await task


async def test_a_cancelled_request_leaves_remote_tier_usable() -> None:
    async with page_server() as srv, peer(srv.address) as client:
        for _ in range(5):
            await _cancel_soon(client.lookup(KEYS))
            assert await client.lookup(KEYS) == 0
        assert client.reconnects == 0


async def test_a_cancelled_request_leaves_remote_cluster_usable() -> None:
    async with (
        page_server() as srv,
        RemoteCluster(srv.address, secret=SECRET, spec=SPEC, timeout=TIMEOUT) as rc,
    ):
        for _ in range(5):
            await _cancel_soon(rc.lookup(KEYS))
            assert await rc.lookup(KEYS) == 0


async def test_remote_tier_reconnects_after_a_broken_connection() -> None:
    async with page_server() as srv, peer(srv.address, retry_after=0.05) as client:
        assert client._ctl is not None
        client._ctl._break()  # as if the server had dropped us
        await asyncio.sleep(0.05)
        assert await client.lookup(KEYS) == 0
        assert client.reconnects == 1


# -- a hostile page server: it authenticates, then answers with malformed replies -----------


def _good_hello() -> dict[str, Any]:
    return {"name": "h", "spec": spec_fields(SPEC), "lease_ttl": 5.0, "transports": {}}


HOSTILE: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = [
    ("lookup", lambda m: {"n": "3"}),
    ("lookup", lambda m: {"n": -1}),
    ("lookup", lambda m: {"n": 10**6}),
    ("acquire", lambda m: {"lease": 1, "slots": ["a"], "gens": [0]}),
    ("acquire", lambda m: {"lease": 1, "slots": [0, 1], "gens": [0]}),
    ("acquire", lambda m: {"lease": [1], "slots": [], "gens": []}),
    ("acquire", lambda m: {"lease": 1, "slots": [-5], "gens": [0]}),
    ("locate", lambda m: {"nodes": [1, 2]}),
    ("locate", lambda m: {"nodes": "x"}),
    ("locate", lambda m: {"nodes": ["127.0.0.1:99999"]}),  # connect()'s OverflowError next
    ("locate", lambda m: {"nodes": ["no-port"]}),
    ("lookup", lambda m: {"err": ["x"], "msg": {"a": 1}}),
    ("lookup", lambda m: {"id": [m["id"]], "n": 0}),  # an unhashable id: dropped, then a timeout
    ("reserve", lambda m: {"lease": 1, "slots": [None]}),
    ("reserve", lambda m: {"lease": 1, "slots": [0]}),  # fewer slots than keys
]


@contextlib.asynccontextmanager
async def hostile_server(
    answer: Callable[[dict[str, Any]], dict[str, Any]], hello: dict[str, Any] | None = None
) -> AsyncIterator[str]:
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        s = StreamSession(r, w, srv_limits())
        with contextlib.suppress(Exception):
            await s.serve_handshake(SECRET, "page-server", "hostile")
            while (msg := await s.recv()) is not None:
                if msg["op"] == "hello":
                    await s.send({"id": msg["id"], **(hello or _good_hello())})
                else:
                    await s.send({"id": msg["id"], **answer(msg)})
        w.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


async def _connected(address: str) -> RemoteTier:
    """A RemoteTier whose control connection is up (the hostile hello offers no transport)."""
    client = peer(address, transport="tcp")
    client._ctl = Control(address, secret=SECRET, timeout=0.5)
    await client._ctl.open()
    client.page_bytes = PAGE
    client._opened = True
    return client


@pytest.mark.parametrize(("op", "answer"), HOSTILE)
async def test_malformed_replies_raise_typed_errors(
    op: str, answer: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    async with hostile_server(answer) as address:
        client = await _connected(address)
        try:
            arr = np.zeros((4, PAGE), np.uint8)
            call = {
                "lookup": lambda: client.lookup(KEYS),
                "acquire": lambda: client.load(KEYS, arr, [0, 1, 2, 3]),
                "locate": lambda: client.locate(KEYS),
                "reserve": lambda: client.publish(KEYS[:2], arr, [0, 1]),
            }[op]
            with pytest.raises(RemoteError):
                await call()
        finally:
            await client.aclose()


@pytest.mark.parametrize(
    "field",
    [
        {"lease_ttl": float("nan")},
        {"lease_ttl": float("inf")},
        {"lease_ttl": -5.0},
        {"lease_ttl": 0},
        {"lease_ttl": 1e300},
        {"lease_ttl": 2**64 - 1},
        {"lease_ttl": True},
        {"lease_ttl": "5"},
        {"name": {"a": [1] * 1000}},
    ],
    ids=["nan", "inf", "negative", "zero", "huge", "huge-int", "bool", "str", "name-map"],
)
async def test_a_hostile_hello_is_refused_after_the_proof(field: dict[str, Any]) -> None:
    """A page server that proves the secret, then sends a hello whose lease_ttl is NaN, inf,
    negative, zero or huge (or a name that is no string): the client took the number as
    given (``lease_ttl`` nan). Now connect raises RemoteProtocolError and keeps nothing."""
    async with hostile_server(lambda m: {}, hello={**_good_hello(), **field}) as address:
        client = peer(address, transport="tcp")
        with pytest.raises(RemoteProtocolError, match=r"lease_ttl|name"):
            await client.connect()
        assert client._ctl is None and client.lease_ttl == 0.0


@pytest.mark.parametrize(
    "kw",
    [
        {"lease_ttl": float("nan")},
        {"lease_ttl": -1},
        {"lease_ttl": 2 * 86400},
        {"lease_ttl": "5"},
        {"timeout": float("nan")},
        {"timeout": -1},
        {"directory_ttl": float("inf")},
        {"max_writing": -5},
        {"watch_pending": 0},
        {"max_conns_per_peer": 0},
        {"max_preauth_failures": 1.5},
        {"refused_hold": -1},
        {"port": -1},
        {"port": 70000},
        {"transports": []},
        {"transports": "tcp"},
    ],
)
async def test_page_server_numbers_are_checked_at_construction(kw: dict[str, Any]) -> None:
    """A careless caller's PageServer numbers: NaN / negative leases and timeouts were taken
    (a lease no client accepts, a hello deadline that never fires), an empty transport list
    failed each hello with an IndexError in the server's task, a port of 70000 bound another
    port. Now a typed InvalidInputError at construction, nothing started."""
    store = KVStore(SPEC, device_bytes=PAGE, host_bytes=4 * PAGE, codec=None)
    async with store:
        with pytest.raises(InvalidInputError):
            PageServer(store, secret=SECRET, **kw)


async def test_a_hostile_server_is_a_counted_miss_inside_kvstore() -> None:
    """Every malformed answer of a source is a miss for `add_sequence`, never an exception."""

    class Hostile:
        def __init__(self, lookup: Any, load: Any) -> None:
            self._lookup, self._load = lookup, load

        async def lookup(self, keys: list[bytes]) -> Any:
            return self._lookup

        async def load(self, keys: list[bytes], array: Any, slots: list[int]) -> Any:
            if isinstance(self._load, BaseException):
                raise self._load
            return self._load

        async def publish(self, keys: list[bytes], array: Any, slots: list[int]) -> Any:
            raise TypeError("hostile")

    cases = [("3", 1), (None, 1), (10**9, "x"), (10**9, ValueError("v")), (2, TypeError("t"))]
    for lookup, load in cases:
        store = KVStore(
            SPEC,
            device_bytes=8 * PAGE,
            host_bytes=8 * PAGE,
            codec=None,
            remote=Hostile(lookup, load),  # type: ignore[arg-type]
            timeout=TIMEOUT,
        )
        async with store:
            assert await store.add_sequence("s", list(range(16))) == 0
            await store.release("s")
            assert store.stats()["remote"]["errors"] >= 1


async def test_a_peer_link_failing_is_not_fatal(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken connection mid-call raises PeerGoneError, not an untyped error."""
    async with page_server() as srv, peer(srv.address) as client:
        await srv.aclose()
        with pytest.raises((PeerGoneError, RemoteProtocolError, RemoteError)):
            await client.lookup(KEYS)


async def test_a_cancelled_request_leaves_a_watch_usable() -> None:
    async with page_server() as srv, peer(srv.address) as client:
        w = await client.watch()
        try:
            for _ in range(5):
                await _cancel_soon(w.add(KEYS))
                assert await w.add(KEYS) == 0  # none held: none watched, and the link lives
        finally:
            await w.aclose()


async def test_a_cancelled_wait_leaves_the_tcp_transport_usable() -> None:
    from tierkv.transports import TransferOp
    from tierkv.transports.tcp import TcpTransport

    async with TcpTransport("a", secret=SECRET) as a, TcpTransport("b", secret=SECRET) as b:
        theirs = b.register_memory(bytearray(os.urandom(1 << 20)))
        mine = a.allocate(1 << 20)
        await a.add_peer(b.metadata())
        ops = [TransferOp(mine, 0, theirs.descriptor, 0, 1 << 20)]
        for _ in range(5):
            handle = a.read(ops)
            await _cancel_soon(handle.wait(TIMEOUT))  # the wait, not the transfer
            await handle.wait(TIMEOUT)
            handle = a.read(ops)
            handle.cancel()  # the transfer itself: later ones reconnect
            await a.read(ops)
            assert bytes(mine.view) == bytes(theirs.view)


@pytest.mark.parametrize(
    "kw",
    [
        {"timeout": float("nan")},
        {"timeout": -1},
        {"timeout": 0},
        {"retry_after": -1},
        {"max_backoff": float("inf")},
        {"timeout": "10"},
    ],
)
def test_client_numbers_are_checked_at_construction(kw: dict[str, Any]) -> None:
    """RemoteTier / RemoteCluster / Watch with a NaN or negative timeout: every wait of the
    client was unbounded (wait_for(nan)) or failed at once; a Watch of max_batches=0 queued
    without bound. Now InvalidInputError (InvalidTypeError for a str) at construction."""
    with pytest.raises(InvalidInputError):
        RemoteTier("127.0.0.1:1", secret=SECRET, spec=SPEC, **kw)
    if "max_backoff" not in kw:
        with pytest.raises(InvalidInputError):
            RemoteCluster(["127.0.0.1:1"], secret=SECRET, spec=SPEC, **kw)
    if "timeout" in kw:
        with pytest.raises(InvalidInputError):
            Watch("127.0.0.1:1", secret=SECRET, **kw)
    with pytest.raises(InvalidInputError, match="max_batches"):
        Watch("127.0.0.1:1", secret=SECRET, max_batches=0)


def test_wrong_objects_are_type_errors_at_construction() -> None:
    """A new user's wrong objects: each was an AttributeError or TypeError from inside (a
    SyncKVStore given to PageServer: no 'tenants'; an int address: no 'rpartition'; seeds=5:
    not iterable), a str secret failed at the first handshake, a str spec was taken. Now
    InvalidTypeError at construction."""
    from tierkv.errors import InvalidTypeError

    with pytest.raises(InvalidTypeError, match="KVStore"):
        PageServer("a store", secret=SECRET)  # type: ignore[arg-type]
    for kw in ({"secret": "s" * 32}, {"spec": "x"}):
        with pytest.raises(InvalidTypeError):
            RemoteTier("127.0.0.1:1", **{"secret": SECRET, **kw})  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="address"):
        RemoteTier(5, secret=SECRET)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="seeds"):
        RemoteCluster(5, secret=SECRET)  # type: ignore[arg-type]
    assert RemoteTier("h:1", secret=bytearray(SECRET)).secret == SECRET


@pytest.mark.parametrize(
    "address", ["127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1:\u0661\u0662", ":5"]
)
def test_a_bad_port_is_refused_at_construction(address: str) -> None:
    """A port of 99999 was connect()'s OverflowError, untyped; Arabic-Indic digits were taken
    as port 12."""
    with pytest.raises(InvalidInputError, match="port"):
        RemoteTier(address, secret=SECRET)
    with pytest.raises(InvalidInputError, match="port"):
        RemoteCluster([address], secret=SECRET)


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "no-port", "h:\u0661"])
async def test_a_cluster_node_address_from_a_peer_is_a_protocol_error(address: str) -> None:
    """Node addresses come from a directory (a Redis not ours) or a seed's locate answer: one
    of port 99999 was connect()'s OverflowError out of the cluster's load, one without a port
    an InvalidInputError past its ``except RemoteError``; now RemoteProtocolError, and the
    node is left alone as after any failure."""
    cluster = RemoteCluster(["127.0.0.1:1"], secret=SECRET, spec=SPEC, timeout=TIMEOUT)
    try:
        with pytest.raises(RemoteProtocolError, match="node address"):
            await cluster.node(address)
        with pytest.raises(PeerGoneError, match="failed recently"):
            await cluster.node(address)
    finally:
        await cluster.aclose()


async def test_concurrent_connects_make_one_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three tasks connecting one RemoteTier at once each made a control connection (and a
    data transport); the last replaced the others without closing them (their reader tasks
    were destroyed pending). Now they share one."""
    opened: list[Control] = []
    real_open = Control.open

    async def counting_open(self: Control) -> Any:
        opened.append(self)
        return await real_open(self)

    monkeypatch.setattr(Control, "open", counting_open)
    async with page_server() as srv:
        client = peer(srv.address)
        got = await asyncio.gather(client.connect(), client.connect(), client.connect())
        try:
            assert all(c is client for c in got)
            assert len(opened) == 1
            assert await client.lookup(KEYS) == 0
        finally:
            await client.aclose()
        watch = Watch(srv.address, secret=SECRET)
        await asyncio.gather(watch.start(), watch.start())  # the same for a Watch
        try:
            assert len(opened) == 2
        finally:
            await watch.aclose()
