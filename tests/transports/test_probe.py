"""The probe decodes what the other end sends within limits: that end may be hostile too."""

from __future__ import annotations

import contextlib
import socket
import threading

import msgpack
import pytest

from tierkv.transports.errors import ProtocolError
from tierkv.transports.probe import REPLY_LIMITS, Probe
from tierkv.transports.session import PREFIX


def _framed(obj: object) -> bytes:
    body = msgpack.packb(obj)
    return PREFIX.pack(len(body)) + body


def _pair() -> tuple[Probe, socket.socket]:
    a, b = socket.socketpair()
    return Probe(a), b


def test_a_reply_within_limits_is_decoded() -> None:
    p, peer = _pair()
    with p, peer:
        peer.sendall(_framed({"ok": True, "keys": [b"k"] * 3}))
        assert p.recv() == {"ok": True, "keys": [b"k"] * 3}


HOSTILE = {
    "4 GiB length, refused before reading": PREFIX.pack(0xFFFFFFFF),
    "frame over the limit": PREFIX.pack(REPLY_LIMITS.frame + 64) + b"\x80",
    "array over the limit": _framed({"keys": list(range(REPLY_LIMITS.array + 1))}),
    "str over the limit": _framed({"s": "x" * (REPLY_LIMITS.str + 1)}),
    "not a map": _framed([1, 2, 3]),
    "not msgpack": PREFIX.pack(1) + b"\xc1",
}


@pytest.mark.parametrize("frame", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_replies_are_typed_errors(frame: bytes) -> None:
    p, peer = _pair()
    with p, peer:
        sender = threading.Thread(target=_send_quietly, args=(peer, frame))
        sender.start()  # a large frame fills the socket buffer: sent while the probe reads
        with pytest.raises(ProtocolError):
            p.recv()
        p.close()  # a refused frame is not drained: the sender stops on the closed socket
        sender.join(5)
        assert not sender.is_alive()


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)
