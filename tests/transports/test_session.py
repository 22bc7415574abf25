"""The session stack (transports/session.py): bounded decodes, tags, handshakes, stream
framing, against random, truncated, oversized and deeply nested input (hypothesis)."""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierkv.transports import AuthError, ProtocolError
from tierkv.transports.session import (
    HELLO_LIMITS,
    PREFIX,
    TAG_BYTES,
    Limits,
    Seal,
    StreamSession,
    proof,
    seals,
    session_keys,
    transcript,
    unpack,
)

LIMITS = Limits(frame=1 << 16, array=64, map=16, str=256, bin=256)
FAST = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))

leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.binary(max_size=300)
    | st.text(max_size=300)
)
values = st.recursive(
    leaves,
    lambda inner: (
        st.lists(inner, max_size=80) | st.dictionaries(st.text(max_size=8), inner, max_size=20)
    ),
    max_leaves=40,
)


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


@FAST
@given(data=st.binary(max_size=2048))
def test_random_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        assert isinstance(unpack(data, LIMITS), dict)


@FAST
@given(obj=values)
def test_values_within_limits_round_trip_and_others_are_refused(obj: Any) -> None:
    body = msgpack.packb({"v": obj}, use_bin_type=True)
    with contextlib.suppress(ProtocolError):  # over a limit: refused
        assert unpack(body, LIMITS) == {"v": obj}


@FAST
@given(obj=values, cut=st.integers(0, 10_000))
def test_truncated_frames_are_refused(obj: Any, cut: int) -> None:
    body = msgpack.packb({"v": obj}, use_bin_type=True)
    cut %= max(1, len(body))
    if cut:
        with pytest.raises(ProtocolError):
            unpack(body[:cut], LIMITS)


@pytest.mark.parametrize("depth", [10, 1023, 1024, 100_000])
def test_deep_nesting_is_bounded(depth: int) -> None:
    """msgpack stops at 1,024 levels (a list each: harmless)."""
    body = b"\x81\xa1v" + _nested(depth)
    if depth >= 1024:  # with the map around it: over 1,024
        with pytest.raises(ProtocolError):
            unpack(body, LIMITS)
    else:
        assert unpack(body, LIMITS)["v"] is not None


def test_the_issue_frame_is_refused_before_allocating() -> None:
    """8.4 M empty arrays in one array: over every limit (the hello's 4 KiB, the array length)."""
    body = b"\xdd" + struct.pack("!I", 8_400_000) + b"\x90" * 8_400_000
    with pytest.raises(ProtocolError):
        unpack(body, HELLO_LIMITS)
    with pytest.raises(ProtocolError):
        unpack(body, Limits(frame=16 << 20, array=1 << 18, map=16, str=256, bin=256))


@FAST
@given(frames=st.lists(st.binary(max_size=64), min_size=1, max_size=8), data=st.data())
def test_tags_catch_forgery_replay_and_reordering(frames: list[bytes], data: Any) -> None:
    keys = session_keys(b"secret", transcript(b"s" * 16, b"c" * 16, "a", "b", "c", "d"))
    tx, _ = seals(keys, server=False)
    _, rx = seals(keys, server=True)
    tags = [tx.tag(f) for f in frames]
    order = data.draw(st.permutations(range(len(frames))))
    for position, i in enumerate(order):
        if i == position:
            rx.check(frames[i], tags[i])
            continue
        with pytest.raises(AuthError):  # reordered (or dropped): the sequence number differs
            rx.check(frames[i], tags[i])
        break
    rx2 = Seal(keys.client_to_server)
    rx2.check(frames[0], tags[0])
    with pytest.raises(AuthError):
        rx2.check(frames[0], tags[0])  # replayed: its sequence number has passed


def test_transcripts_do_not_collide_and_proofs_are_directional() -> None:
    a = transcript(b"n1", b"n2", "page-server", "ab", "client", "c")
    b = transcript(b"n1", b"n2", "page-server", "a", "client", "bc")
    assert a != b
    assert proof(b"k", "client", a) != proof(b"k", "server", a)
    ka, kb = session_keys(b"k", a), session_keys(b"k", b)
    assert ka.client_to_server != ka.server_to_client != kb.server_to_client


async def _feed(data: bytes, authenticated: bool) -> list[Any]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    session = StreamSession(reader, _NullWriter(), LIMITS)  # type: ignore[arg-type]
    if authenticated:
        session._tx, session._rx = seals(session_keys(b"k", b"t"), server=True)
    out: list[Any] = []
    try:
        while (msg := await session.recv()) is not None:
            out.append(msg)
    except (ProtocolError, AuthError) as exc:
        out.append(exc)
    return out


class _NullWriter:
    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def _frame(obj: Any, seal: Seal | None) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    tag = seal.tag(body) if seal is not None else b""
    return PREFIX.pack(len(body) + len(tag)) + body + tag


@FAST
@given(
    chunks=st.lists(
        st.one_of(
            st.binary(max_size=64),
            st.builds(lambda o: _frame({"op": o}, None), values),
            st.integers(0, 2**32 - 1).map(PREFIX.pack),
        ),
        max_size=6,
    ),
    authenticated=st.booleans(),
)
def test_stream_framing_never_fails_untyped(chunks: list[bytes], authenticated: bool) -> None:
    out = asyncio.run(_feed(b"".join(chunks), authenticated))
    for item in out[:-1]:
        assert isinstance(item, dict)


def test_tagged_frames_pass_and_untagged_ones_do_not() -> None:
    keys = session_keys(b"k", b"t")
    tx, _ = seals(keys, server=False)
    good = _frame({"op": "a"}, tx) + _frame({"op": "b"}, tx)
    assert asyncio.run(_feed(good, True)) == [{"op": "a"}, {"op": "b"}]
    tx, _ = seals(keys, server=False)
    first = _frame({"op": "a"}, tx)
    out = asyncio.run(_feed(first + first, True))
    assert out[0] == {"op": "a"} and isinstance(out[1], AuthError)
    out = asyncio.run(_feed(_frame({"op": "a"}, None), True))
    assert len(out) == 1 and isinstance(out[0], (AuthError, ProtocolError))
    big = PREFIX.pack(LIMITS.frame + TAG_BYTES + 1)
    assert isinstance(asyncio.run(_feed(big, True))[0], ProtocolError)
