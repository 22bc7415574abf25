"""A live page server fuzzed (hypothesis): random, truncated, oversized and deeply nested frames
before and after authentication. It never fails untyped, never leaks a lease, keeps serving;
so does a server with tenants, fuzzed by a client authenticated as one of them."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv import KVSpec
from tierkv.remote import PageServer
from tierkv.store import KVStore
from tierkv.transports.probe import Probe
from tierkv.transports.session import HELLO_MAX, PREFIX

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="fp32", page_tokens=4)
SECRET = b"fuzz"
TENANTS = {"acme": b"fuzz-acme"}
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))


class Server:
    """A page server on its own loop in a thread."""

    def __init__(self, tenant: str | None = None) -> None:
        self.tenant = tenant
        self.loop = asyncio.new_event_loop()
        self.errors: list[dict[str, Any]] = []
        self.loop.set_exception_handler(lambda _, ctx: self.errors.append(ctx))
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.store = KVStore(SPEC, device_bytes=SPEC.page_bytes, host_bytes=64 * SPEC.page_bytes)
        self.call(self.store.open())
        self.srv = PageServer(
            self.store,
            secret=SECRET,
            secrets=TENANTS if tenant else None,
            timeout=2.0,
            max_preauth_per_peer=64,
        )
        self.call(self.srv.start())

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(20)

    def stats(self) -> dict[str, Any]:
        async def get() -> dict[str, Any]:
            return self.srv.stats()

        return dict(self.call(get()))

    def probe(self, authenticate: bool) -> Probe:
        p = Probe.connect(self.srv.host, self.srv.port)
        if authenticate and self.tenant is not None:
            assert p.handshake(TENANTS[self.tenant], tenant=self.tenant)["op"] == "welcome"
        elif authenticate:
            assert p.handshake(SECRET)["op"] == "welcome"
        return p

    def healthy(self) -> bool:
        with self.probe(True) as p:
            p.send({"op": "lookup", "id": 7, "keys": [b"k" * 32]})
            return p.recv() == {"id": 7, "n": 0}

    def close(self) -> None:
        self.call(self.srv.aclose())
        self.call(self.store.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module", params=[None, "acme"], ids=["no-tenants", "tenant"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(request.param)
    yield s
    s.close()


def _drain(p: Probe, data: bytes) -> None:
    """Send, half-close, read until the server closes (it has then handled every byte)."""
    with p:
        try:
            p.sock.sendall(data)
            p.sock.shutdown(socket.SHUT_WR)
            p.sock.settimeout(5)
            while p.sock.recv(1 << 16):
                pass
        except OSError:
            pass


ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack encodes
keys = st.lists(st.binary(min_size=0, max_size=70), max_size=6)
fields = st.fixed_dictionaries(
    {
        "op": st.sampled_from(
            [
                "hello",
                "lookup",
                "acquire",
                "release",
                "reserve",
                "commit",
                "stats",
                "locate",
                "watch",
                "unwatch",
                "hold",
                "auth",
                "zz",
            ]
        )
    },
    optional={
        "id": ints | st.text(max_size=3) | st.none(),
        "keys": keys | ints | st.text(max_size=4),
        "lease": ints | st.binary(max_size=4),
        "ok": st.booleans() | ints,
        "node": st.text(max_size=30) | ints,
        "add": keys,
        "drop": keys,
        "full": st.booleans(),
        "mac": st.binary(max_size=40),
        "nonce": st.binary(max_size=20),
        "role": st.sampled_from(["client", "page-server", ""]),
        "tenant": st.sampled_from(["acme", "beta", ""]) | ints | st.none(),
    },
)


def _raw(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


garbage = st.one_of(
    st.binary(max_size=256),
    st.integers(0, 2**32 - 1).map(PREFIX.pack),  # a length and nothing after it
    st.builds(lambda n: PREFIX.pack(n) + bytes(min(n, HELLO_MAX + 8)), st.integers(0, 1 << 24)),
    st.integers(1, 5000)
    .map(lambda d: b"\x91" * d + b"\xc0")
    .map(lambda b: PREFIX.pack(len(b)) + b),
    st.builds(
        lambda h, cut: (PREFIX.pack(len(_raw(h))) + _raw(h))[:cut], fields, st.integers(0, 64)
    ),
)


@FUZZ
@given(data=garbage)
def test_before_authentication(server: Server, data: bytes) -> None:
    p = server.probe(False)
    assert p.recv()["op"] == "challenge"  # type: ignore[index]
    _drain(p, data)


@FUZZ
@given(frames=st.lists(fields, min_size=1, max_size=4), tail=st.none() | garbage)
def test_after_authentication(
    server: Server, frames: list[dict[str, Any]], tail: bytes | None
) -> None:
    p = server.probe(True)
    data = b"".join(p.frame(f) for f in frames)
    _drain(p, data + (tail or b""))


def test_still_serving_and_nothing_leaked(server: Server) -> None:
    assert server.healthy()
    st_ = server.stats()
    assert st_["leases"] == 0  # every fuzzed connection's leases ended with it
    assert not server.errors, server.errors[:3]
