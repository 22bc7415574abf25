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

from transports.tcp_wire import PREFIX, frame, mac


def recv_frame(conn: socket.socket) -> dict:
    (n,) = PREFIX.unpack(conn.recv(4, socket.MSG_WAITALL))
    return msgpack.unpackb(conn.recv(n, socket.MSG_WAITALL))


def main(secret: bytes) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    meta = msgpack.packb({"transport": "tcp", "agent": "dying", "host": "127.0.0.1", "port": port})
    print("READY", meta.hex(), flush=True)
    conn, _ = srv.accept()
    nonce = secrets.token_bytes(16)
    conn.sendall(frame({"op": "challenge", "agent": "dying", "nonce": nonce}))
    auth = recv_frame(conn)
    proof = mac(secret, b"tierkv-server", auth["nonce"], nonce, b"dying")
    conn.sendall(frame({"op": "welcome", "mac": proof, "max_payload": 1 << 26, "max_segs": 8192}))
    req = recv_frame(conn)
    n = sum(s[2] for s in req["segs"])
    conn.sendall(frame({"op": "data", "id": req["id"], "n": n}) + b"\xee" * (n // 2))
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main(bytes.fromhex(sys.argv[1]))
