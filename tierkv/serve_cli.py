"""``tierkv serve``: run a store and a page server that exposes its host tier to peers."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import Any

from runtime import new_event_loop
from tierkv.remote import PageServer
from tierkv.spec import KVSpec, parse_dtype
from tierkv.store import KVStore


def add_parser(sub: Any) -> None:
    """Register the ``serve`` subcommand."""
    p = sub.add_parser(
        "serve",
        help="serve this node's host tier to peers (page server)",
        description="Opens a store with the given page layout and serves its host tier: peers "
        "look pages up on the control socket (--listen) and read or write them one-sidedly "
        "through the data transports (shm on this host, tcp across hosts). Runs until "
        "interrupted. The secret comes from --secret or $TIERKV_TRANSPORT_SECRET.",
    )
    p.add_argument("--listen", default="127.0.0.1:7600", help="control socket host:port")
    p.add_argument(
        "--transport",
        action="append",
        choices=["tcp", "shm"],
        help="data transport (repeat for several; default tcp)",
    )
    p.add_argument("--secret", help="shared secret (hex); default $TIERKV_TRANSPORT_SECRET")
    p.add_argument("--host-mb", type=float, default=256.0, help="host tier size, MiB")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="fp16")
    p.add_argument("--page-tokens", type=int, default=16)
    p.add_argument("--lease-ttl", type=float, default=10.0, help="seconds a peer may pin pages")
    p.add_argument("--every", type=float, default=10.0, help="seconds between status lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_serve(args))
    finally:
        loop.close()


async def _serve(args: argparse.Namespace) -> int:
    host, _, port = args.listen.rpartition(":")
    spec = KVSpec(
        args.layers, args.kv_heads, args.head_dim, parse_dtype(args.dtype), args.page_tokens
    )
    secret = bytes.fromhex(args.secret) if args.secret else None
    host_bytes = int(args.host_mb * 2**20)
    store = KVStore(spec, device_bytes=spec.page_bytes, host_bytes=host_bytes, codec=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with store:
        server = PageServer(
            store,
            transports=args.transport or ["tcp"],
            host=host or "127.0.0.1",
            port=int(port or 0),
            secret=secret,
            lease_ttl=args.lease_ttl,
        )
        async with server:
            pages = store.tiers.table.capacity("host")
            print(
                f"serving {pages} host pages ({spec.page_bytes} B each) on {server.address} "
                f"via {', '.join(server.kinds)}",
                flush=True,
            )
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), args.every)
                s = server.stats()
                print(
                    f"pages {s['pages']}/{s['host_capacity']}  leases {s['leases']}  "
                    f"expired {s['expired']}",
                    file=sys.stderr,
                    flush=True,
                )
    print("stopped", flush=True)
    return 0
