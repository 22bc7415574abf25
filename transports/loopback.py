"""Loopback: peers in the same process. A read or write is one memcpy per op.

Agents find each other through a process-wide table of live loopback transports, so two
`LoopbackTransport`s in one process exchange metadata exactly as remote peers would.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from .base import Direction, Transport
from .errors import PeerError
from .handle import BatchHandle
from .regions import MEMORY_KINDS, Capabilities, TransferOp

__all__ = ["LoopbackTransport"]

_AGENTS: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()


class LoopbackTransport(Transport):
    """Same-process transport: the initiator copies straight from / into the target's region."""

    kind = "loopback"
    capabilities = Capabilities(frozenset(MEMORY_KINDS[:2]), "native", "process")

    async def _start(self) -> None:
        other = _AGENTS.get(self.name)
        if other is not None and other is not self and not other.closed:
            raise PeerError(f"a loopback agent named {self.name!r} is already running")
        _AGENTS[self.name] = self

    async def _close(self) -> None:
        if _AGENTS.get(self.name) is self:
            del _AGENTS[self.name]

    def _peer_fields(self) -> dict[str, Any]:
        return {"pid": os.getpid()}

    async def _add_peer(self, info: dict[str, Any]) -> None:
        if info.get("pid") != os.getpid():
            raise PeerError(f"loopback peer {info['agent']!r} lives in another process")
        self._target(info["agent"])

    def _target(self, agent: str) -> LoopbackTransport:
        peer = _AGENTS.get(agent)
        if peer is None or peer.closed:
            raise PeerError(f"loopback peer {agent!r} is gone")
        return peer

    async def _transfer(
        self,
        direction: Direction,
        ops: list[TransferOp],
        notify: bytes | None,
        handle: BatchHandle,
    ) -> None:
        targets: dict[str, LoopbackTransport] = {}
        for local, lo, remote, ro, n in ops:
            peer = targets.get(remote.agent) or self._target(remote.agent)
            targets[remote.agent] = peer
            theirs = peer.serve_view(remote.region_id, ro, n)
            if direction == "read":
                local.view[lo : lo + n] = theirs
            else:
                theirs[:] = local.view[lo : lo + n]
        if notify is not None:
            for peer in targets.values():
                peer.deliver_notification(self.name, bytes(notify))
