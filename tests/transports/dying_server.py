"""A tcp peer that dies mid-transfer: it authenticates, answers the first read with a header and
half its payload, then SIGKILLs itself. Prints ``READY <metadata hex>``.

    python dying_server.py SECRET_HEX
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys

import msgpack

from tierkv.transports.session import proof, seals, session_keys, transcript
from tierkv.transports.tcp_wire import PREFIX, frame


def recv_frame(conn: socket.socket, tagged: bool = False) -> dict:
    (n,) = PREFIX.unpack(conn.recv(4, socket.MSG_WAITALL))
    raw = conn.recv(n, socket.MSG_WAITALL)
    return msgpack.unpackb(raw[:-16] if tagged else raw)


def main(secret: bytes) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    meta = msgpack.packb({"transport": "tcp", "agent": "dying", "host": "127.0.0.1", "port": port})
    print("READY", meta.hex(), flush=True)
    conn, _ = srv.accept()
    nonce = secrets.token_bytes(16)
    conn.sendall(frame({"op": "challenge", "v": 3, "agent": "dying", "nonce": nonce}))
    auth = recv_frame(conn)
    t = transcript(nonce, auth["nonce"], "tcp-server", "dying", "tcp-client", auth["agent"])
    welcome = {"op": "welcome", "v": 3, "csum": "crc32", "mac": proof(secret, "server", t)}
    conn.sendall(frame({**welcome, "max_payload": 1 << 26, "max_segs": 8192}))
    tx, _ = seals(session_keys(secret, t), server=True)
    req = recv_frame(conn, tagged=True)  # its tag is not checked: we die anyway
    n = sum(s[2] for s in req["segs"])
    conn.sendall(frame({"op": "data", "id": req["id"], "n": n}, tx) + b"\xee" * (n // 2))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(bytes.fromhex(sys.argv[1]))
