"""``tierkv serve``: run a store and a page server that exposes its host tier to peers.

::

    tierkv serve --listen 127.0.0.1:7600 --metrics 127.0.0.1:9600 --trace serve.json

Security (docs/security.md): a shared secret is required (``--secret`` or
``$TIERKV_TRANSPORT_SECRET``; an empty one is an error). ``--insecure`` serves without one, and
then only on a loopback address; a non-loopback ``--listen`` without a secret refuses to start.
On start, shared-memory segments left by serve processes that are gone are removed.

``--metrics`` serves Prometheus ``GET /metrics`` (the store's and the page server's figures,
``tierkv.metrics``); ``--trace`` records the store's timeline plus counter samples of the host
tier and the page server every ``--sample-every`` seconds, in a ring of ``--trace-events``
events, and writes it as a Chrome trace when the server stops (SIGINT / SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from tierkv.cli.tenants_file import read_tenants
from tierkv.errors import InvalidInputError, TierKVError
from tierkv.remote import PageServer, RemoteError
from tierkv.remote.protocol.exposure import SECRET_ENV, is_loopback
from tierkv.remote.protocol.tenancy import check_secrets
from tierkv.runtime import new_event_loop
from tierkv.spec import KVSpec, parse_dtype
from tierkv.store import KVStore
from tierkv.timeline import Timeline
from tierkv.transports.shm import remove_stale_segments

TRACE_EVENTS = 100_000


def add_parser(sub: Any) -> None:
    """Register the ``serve`` subcommand."""
    p = sub.add_parser(
        "serve",
        help="serve this node's host tier to peers (page server)",
        description="Opens a store with the given page layout and serves its host tier: peers "
        "look pages up on the control socket (--listen) and read or write them one-sidedly "
        "through the data transports (shm on this host, tcp across hosts). Runs until "
        "interrupted. The secret comes from --secret or $TIERKV_TRANSPORT_SECRET (required "
        "unless --insecure, which keeps the server on loopback).",
    )
    p.add_argument("--listen", default="127.0.0.1:7600", help="control socket host:port")
    p.add_argument(
        "--transport",
        action="append",
        choices=["tcp", "shm"],
        help="data transport (repeat for several; default tcp)",
    )
    p.add_argument("--secret", help="shared secret (hex); default $TIERKV_TRANSPORT_SECRET")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="serve without a secret (anyone who can connect may read and write pages); "
        "only on a loopback --listen",
    )
    p.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        metavar="UID",
        help="another user id admitted on the shm control socket (repeat; default: ours only)",
    )
    p.add_argument(
        "--tenants",
        metavar="FILE",
        help="per-tenant secrets, one 'NAME HEX' a line ('#' comments; the file readable by "
        "its owner only): a client that names a tenant proves its secret and reads and "
        "publishes only that tenant's pages (docs/security.md, Tenants)",
    )
    p.add_argument("--host-mb", type=float, default=256.0, help="host tier size, MiB")
    p.add_argument("--layers", type=int, default=4, help="model layers (page layout)")
    p.add_argument("--kv-heads", type=int, default=2, help="KV heads per layer (page layout)")
    p.add_argument("--head-dim", type=int, default=32, help="head dimension (page layout)")
    p.add_argument("--dtype", default="fp16", help="KV dtype: fp16, bf16, fp32 ...")
    p.add_argument("--page-tokens", type=int, default=16, help="tokens per page")
    p.add_argument("--lease-ttl", type=float, default=10.0, help="seconds a peer may pin pages")
    p.add_argument("--every", type=float, default=10.0, help="seconds between status lines")
    p.add_argument(
        "--directory",
        metavar="URL",
        help="the cluster directory to register in and publish this node's pages to: "
        "redis://[[user]:password@]host:port/db or rediss:// (TLS); Redis or Valkey, standalone "
        "or cluster. Without it, clients find this node's pages by asking it",
    )
    p.add_argument(
        "--directory-ttl",
        type=float,
        default=5.0,
        help="seconds this node stays in the directory's answers without a refresh (a killed "
        "node leaves them within it)",
    )
    p.add_argument(
        "--advertise",
        metavar="HOST:PORT",
        help="the address clients use to reach this server, and its node id in the directory "
        "(default: the listening address)",
    )
    p.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus GET /metrics there (port 0: any free port; needs the server "
        "extra: aiohttp, prometheus-client)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE.json",
        help="record a Chrome trace (Perfetto) and write it there on exit",
    )
    p.add_argument(
        "--trace-events",
        type=int,
        default=TRACE_EVENTS,
        help="events the trace keeps (a ring: the newest; about 200 bytes each in the file)",
    )
    p.add_argument(
        "--sample-every",
        type=float,
        default=1.0,
        help="seconds between counter samples of the host tier and page server in the trace",
    )
    p.set_defaults(func=run)


def parse_address(text: str, flag: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (``[v6]:PORT``; an empty host is 127.0.0.1).

    Raises ValueError naming ``flag`` when malformed.
    """
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidInputError(f"{flag} must be HOST:PORT with a port in [0, 65535], got {text!r}")
    return host or "127.0.0.1", int(port)


def _secret(args: argparse.Namespace) -> bytes | None:
    """The secret to serve with (None: insecure). Raises ValueError: empty, missing without
    --insecure, not hex, or no secret on a non-loopback --listen."""
    if args.secret is not None:
        if not args.secret:
            raise InvalidInputError("--secret is empty: an empty secret is not a secret")
        try:
            secret: bytes | None = bytes.fromhex(args.secret)
        except ValueError as exc:  # (it names the bad character's place)
            raise InvalidInputError(f"--secret is not hex: {exc}") from None
    else:
        env = os.environ.get(SECRET_ENV)
        if env is not None and not env:
            raise InvalidInputError(f"${SECRET_ENV} is empty: an empty secret is not a secret")
        secret = env.encode() if env else None
    host, _ = parse_address(args.listen, "--listen")
    if secret is None and not args.insecure:
        raise InvalidInputError(f"no secret: pass --secret or set ${SECRET_ENV} (or --insecure)")
    if secret is None and not is_loopback(host):
        raise InvalidInputError(
            f"--listen {host} is not loopback: serving without a secret stays there"
        )
    return secret


def _check(args: argparse.Namespace) -> None:
    """Raise ValueError for arguments that cannot work, before anything is opened."""
    parse_address(args.listen, "--listen")
    if args.metrics:
        parse_address(args.metrics, "--metrics")
    if args.advertise is not None:  # (any text was registered: no client could reach it)
        _, port = parse_address(args.advertise, "--advertise")
        if not args.advertise.rpartition(":")[0] or port == 0:
            raise InvalidInputError(
                f"--advertise must name the host and a port clients reach, got {args.advertise!r}"
            )
    for name in ("host_mb", "lease_ttl", "every", "sample_every", "directory_ttl"):
        if not 0 < getattr(args, name) < math.inf:  # (NaN and inf too)
            raise InvalidInputError(f"--{name.replace('_', '-')} must be > 0 and finite")
    if any(uid < 0 for uid in args.allow_uid):
        raise InvalidInputError(f"--allow-uid must be a user id >= 0, got {args.allow_uid}")
    if args.tenants is not None and not args.tenants:
        raise InvalidInputError("--tenants is empty: give the file of the tenants' secrets")
    for name in ("layers", "kv_heads", "head_dim", "page_tokens", "trace_events"):
        if getattr(args, name) < 1:
            raise InvalidInputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.trace:
        folder = os.path.dirname(os.path.abspath(args.trace))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise InvalidInputError(f"--trace: cannot write into {folder}")
    spec = _spec(args)  # SpecError (a ValueError): a layout no page can have
    if int(args.host_mb * 2**20) < spec.page_bytes:
        raise InvalidInputError(
            f"--host-mb {args.host_mb:g} holds no page: pages are {spec.page_bytes} bytes"
        )
    if args.directory:
        from tierkv.remote.membership.redis_directory import check_url

        check_url(args.directory)  # DirectoryURLError (a ValueError) for one that does not parse
    secret = _secret(args)
    if args.tenants is not None:
        check_secrets(read_tenants(args.tenants), secret or b"")


def _spec(args: argparse.Namespace) -> KVSpec:
    """The page layout the flags give (SpecError: an unknown dtype, a page over the limit)."""
    dtype = parse_dtype(args.dtype)
    return KVSpec(args.layers, args.kv_heads, args.head_dim, dtype, args.page_tokens)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT / SIGTERM. Exit status 2: bad arguments (a configuration the store
    or the page server refuses at start, too); 1: could not start."""
    try:
        _check(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop()
    try:
        return loop.run_until_complete(_serve(args))
    except InvalidInputError as exc:  # a configuration refused at open: still a usage error
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (RemoteError, TierKVError, OSError, ImportError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        loop.close()


async def _serve(args: argparse.Namespace) -> int:
    host, port = parse_address(args.listen, "--listen")
    spec = _spec(args)
    secret = _secret(args)
    stale = remove_stale_segments()
    if stale:
        print(f"removed {len(stale)} stale shared-memory segments: {', '.join(stale)}", flush=True)
    if secret is None:
        print(f"warning: serving without a secret on {host} (--insecure)", file=sys.stderr)
    host_bytes = int(args.host_mb * 2**20)
    store = KVStore(spec, device_bytes=spec.page_bytes, host_bytes=host_bytes, codec=None)
    # a ring of the newest events; set before open(), which hands it to the tiers
    store.timeline = Timeline(enabled=bool(args.trace), max_events=args.trace_events)
    stop = asyncio.Event()
    started = False
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with store:
            server = PageServer(
                store,
                transports=args.transport or ["tcp"],
                host=host,
                port=port,
                secret=secret,
                insecure=secret is None,
                lease_ttl=args.lease_ttl,
                transport_options={"shm": {"allow_uids": args.allow_uid}},
                directory=args.directory,
                directory_ttl=args.directory_ttl,
                advertise=args.advertise,
                secrets=read_tenants(args.tenants) if args.tenants is not None else None,
            )
            async with server, _metrics_http(server, args.metrics):
                pages = store.tiers.table.capacity("host")
                names = ", ".join(server.tenants.secrets)
                print(
                    f"serving {pages} host pages ({spec.page_bytes} B each) on {server.address} "
                    f"via {', '.join(server.kinds)}" + (f" for tenants {names}" if names else ""),
                    flush=True,
                )
                started = True
                await _until_stopped(server, stop, args)
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        if args.trace and started:
            store.timeline.write(args.trace)
            tl = store.timeline
            print(
                f"trace written to {args.trace} ({len(tl)} events, {tl.dropped} dropped)",
                flush=True,
            )
    print("stopped", flush=True)
    return 0


@contextlib.asynccontextmanager
async def _metrics_http(server: PageServer, address: str | None) -> AsyncIterator[None]:
    """Serve the metrics of ``server`` and its store at ``address`` while in the block."""
    if not address:
        yield
        return
    try:
        import aiohttp  # noqa: F401  (start_http_server imports it on first use)

        from tierkv import metrics
    except ImportError as exc:
        raise ImportError(
            "--metrics needs prometheus-client and aiohttp: "
            f"pip install 'tierkv-cache[server]' ({exc})"
        ) from exc

    host, port = parse_address(address, "--metrics")
    runner, url = await metrics.start_http_server(server, host, port)
    print(f"metrics on {url}", flush=True)
    try:
        yield
    finally:
        await runner.cleanup()


async def _until_stopped(server: PageServer, stop: asyncio.Event, args: argparse.Namespace) -> None:
    """Status lines every ``--every`` s and trace samples every ``--sample-every`` s."""
    tl = server.store.timeline
    period = min(args.every, args.sample_every) if tl.enabled else args.every
    next_status = time.monotonic() + args.every
    _sample(server)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period)
        _sample(server)
        if stop.is_set() or time.monotonic() >= next_status:
            next_status = time.monotonic() + args.every
            s = server.stats()
            print(
                f"pages {s['pages']}/{s['host_capacity']}  leases {s['leases']}  "
                f"expired {s['expired']}  watchers {s['watchers']}"
                f"{_directory_status(s)}",
                file=sys.stderr,
                flush=True,
            )


def _directory_status(s: dict[str, Any]) -> str:
    """The directory's part of a status line (nothing without a directory)."""
    if "directory_registered" not in s:
        return ""
    state = "registered" if s["directory_registered"] else "NOT registered"
    return (
        f"  directory {state}: {s['directory_published']} pages published, "
        f"{s['directory_errors_total']} errors"
    )


def _sample(server: PageServer) -> None:
    """Counter samples of the page server and the store into the trace (when recording)."""
    tl = server.store.timeline
    if not tl.enabled:
        return
    t = time.perf_counter()
    s = server.stats()
    tl.counter(
        "page server",
        t,
        pages=s["pages"],
        host_used=s["host_used"],
        leases=s["leases"],
        expired=s["expired"],
    )
    st = server.store.stats()
    tl.counter(
        "store",
        t,
        page_loads=st["page_loads"],
        written_back=st["written_back"],
        bytes_h2d=st["bytes_h2d"],
        bytes_d2h=st["bytes_d2h"],
    )
