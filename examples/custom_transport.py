"""A complete custom transport in under 100 lines: one-sided ops *emulated* by a server task.

`QueueTransport` peers live in one process; each runs a server task that serves requests posted
on its queue (as a network transport's server would), instead of letting the initiator copy.
Registered with `transports.register`, then created by name. Run it from the repository root:
``PYTHONPATH=. python examples/custom_transport.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import tierkv.transports as transports
from tierkv.transports import Capabilities, PeerError, TransferOp, Transport, group_by_peer
from tierkv.transports.base import Direction
from tierkv.transports.handle import BatchHandle

_SERVERS: dict[str, QueueTransport] = {}  # agent name -> transport (one process)


class QueueTransport(Transport):
    """Same-process transport whose target serves every batch from a request queue."""

    kind = "queue"
    capabilities = Capabilities(frozenset({"host"}), "emulated", "process")

    async def _start(self) -> None:
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self._server = asyncio.create_task(self._serve())
        _SERVERS[self.name] = self

    async def _close(self) -> None:
        _SERVERS.pop(self.name, None)
        self._server.cancel()
        await asyncio.gather(self._server, return_exceptions=True)

    async def _add_peer(self, info: dict[str, Any]) -> None:
        if info["agent"] not in _SERVERS:
            raise PeerError(f"no queue transport named {info['agent']!r} here")

    async def _serve(self) -> None:
        while True:
            direction, ops, notify, sender, done = await self._requests.get()
            try:  # bounds-checked against our registered regions by serve_view
                for local, lo, remote, ro, n in ops:
                    ours = self.serve_view(remote.region_id, ro, n)
                    if direction == "read":
                        local.view[lo : lo + n] = ours
                    else:
                        ours[:] = local.view[lo : lo + n]
                if notify is not None:
                    self.deliver_notification(sender, notify)
                done.set_result(None)
            except Exception as exc:  # report to the initiator, keep serving
                done.set_exception(exc)

    async def _transfer(
        self,
        direction: Direction,
        ops: list[TransferOp],
        notify: bytes | None,
        handle: BatchHandle,
    ) -> None:
        by_peer = group_by_peer(ops)
        waits = []
        for agent, batch in by_peer.items():
            server = _SERVERS.get(agent)
            if server is None:
                raise PeerError(f"peer {agent!r} is gone")
            done = asyncio.get_running_loop().create_future()
            server._requests.put_nowait((direction, batch, notify, self.name, done))
            waits.append(done)
        await asyncio.gather(*waits)


transports.register("queue", QueueTransport, replace=True)


async def main() -> None:
    """Two agents: `a` writes 1 MiB into `b` and notifies it, then reads it back."""
    async with transports.create("queue", name="a") as a, transports.create("queue", name="b") as b:
        data = bytes(range(256)) * 4096
        mine, theirs = a.register_memory(bytearray(data)), b.allocate(len(data))
        await a.add_peer(b.metadata())
        pages = [
            TransferOp(mine, off, theirs.descriptor, off, 4096) for off in range(0, len(data), 4096)
        ]
        await a.write(pages, notify=b"written")
        print("b got", await b.get_notification(timeout=5))
        mine.view[:] = bytes(len(data))
        await a.read(pages)
        print("read back bit-exact:", bytes(mine.view) == data)


if __name__ == "__main__":
    __import__("argparse").ArgumentParser(description=__doc__).parse_args()  # --help: this
    asyncio.run(main())
