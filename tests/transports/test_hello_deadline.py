"""Every listener drops a peer that has not completed the hello within min(timeout, 5 s), not
within its whole timeout (issue 23: the tcp transport used its timeout, 10 s under `tierkv
serve`). Checked through the deadline each uses and, with a small one, the connection's end."""

from __future__ import annotations

import asyncio
import socket

import pytest

import tierkv.transports.shm as shm_mod
import tierkv.transports.tcp as tcp_mod
from tierkv.transports.session import HELLO_DEADLINE
from tierkv.transports.shm import ShmTransport
from tierkv.transports.tcp import TcpTransport

SECRET = b"hello-deadline"
BOUND = 20.0  # only bounds a broken test: the connection ends after SMALL


SMALL = 0.2


async def _until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes (the challenge, then EOF or a reset)."""
    got = b""
    try:
        while chunk := await asyncio.wait_for(reader.read(1 << 16), BOUND):
            got += chunk
    except ConnectionResetError:
        pass
    return got


def test_the_tcp_deadline_is_at_most_the_hello_deadline() -> None:
    t = TcpTransport(secret=SECRET, timeout=10.0)
    assert t._serving.hello_deadline == HELLO_DEADLINE == 5.0
    assert TcpTransport(secret=SECRET, timeout=1.0)._serving.hello_deadline == 1.0


async def test_a_silent_tcp_peer_is_dropped_at_the_hello_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp_mod, "HELLO_DEADLINE", SMALL)
    async with TcpTransport(secret=SECRET, timeout=60.0) as t:  # the timeout is not the bound
        assert t._serving.hello_deadline == SMALL
        reader, writer = await asyncio.open_connection(t.host, t.port)
        got = await _until_closed(reader)
        writer.close()
        assert got  # the challenge came, then the end
        assert t.audit.by_reason["budget_hit:hello_deadline"] == 1


async def test_a_silent_shm_peer_is_dropped_at_the_hello_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(shm_mod, "HELLO_DEADLINE", SMALL)
    async with ShmTransport(secret=SECRET, timeout=60.0) as t:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, t._address)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        await _until_closed(reader)
        writer.close()
        assert t.audit.by_reason["budget_hit:hello_deadline"] == 1
