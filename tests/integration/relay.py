"""A party without the secret between a client and a page server: it forwards frames both
ways and records them; tests inject frames through it or cut the line."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tierkv.remote import PageServer
from tierkv.transports.session import PREFIX


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: list[bytes]) -> None:
    with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
        while True:
            (n,) = PREFIX.unpack(await src.readexactly(4))
            body = await src.readexactly(n)
            log.append(PREFIX.pack(n) + body)
            dst.write(PREFIX.pack(n) + body)
            await dst.drain()
    dst.close()  # one side ended: so does the other


@contextlib.asynccontextmanager
async def relay(target: PageServer) -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A party without the secret between a client and the server: it forwards frames both
    ways and records them (``state["up"]``: client -> server; ``state["writer"]``: its
    connection to the server, to inject frames)."""
    state: dict[str, Any] = {"up": [], "down": []}
    tasks: list[asyncio.Task[None]] = []

    async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection(target.host, target.port)
        state["writer"] = sw
        tasks.append(asyncio.create_task(_pipe(sr, w, state["down"])))
        await _pipe(r, sw, state["up"])

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", state
    finally:
        server.close()
        for t in tasks:
            t.cancel()
        if "writer" in state:
            state["writer"].close()
