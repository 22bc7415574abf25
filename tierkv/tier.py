"""The tier interface and the registry of moves between tiers' media (issue 25, point 1).

A tier owns its medium and its slots; the core moves pages between two tiers by looking up the
handler registered for the pair of media, never by naming a tier::

    moves = Moves()
    moves.register(HOST, DISK, save)          # save(engine, tier, batch) -> handle
    handle = moves.get(HOST, tier.medium)(engine, tier, Batch(keys, host_arena, slots))

A handler queues its move as one job of the :class:`~tierkv.runtime.TransferEngine` and
returns the job's handle at once. What it moves is one `Batch`: the pages' keys, the arena and
slots of the core's end of the move, and what crosses with the bytes: the checksums the page
table knows of pages going out (``sums``: a page source declares them to its peer) and, for
pages coming in, a `~tierkv.page_sums.PageCheck` the move fills with the checksums it verified
and the pages that failed (``check``: the core records the first, counts the second). The
job's result is a list, one item per key: for a write into a tier, a status whose ``held`` is
True when the page is on that tier afterwards (the disk's ``StoreStatus``); for a read into the
host, True for a verified hit (or a count: the first pages delivered, as a page source says).
What a tier may hold (`Holds`) is the tier's own rule: the core asks `Tier.accepts` before it
moves a page there.

The tier core's own moves are handlers of the same registry: device <-> host (`copy_move`, one
engine copy), host -> cold (encode) and cold -> device / host (decode, registered by
:class:`~tierkv.lower_tiers.ColdStorage`, which owns the codec); the other end of those moves is
a `Target` (an arena of the core, its slots, the job's priority). A lower tier's moves (host <->
disk: :mod:`tierkv.disk.tier`) get the `Tier` itself as the other end; the lower chain registers
them in the same registry, the core's, when it attaches (`tierkv.chain.LowerChain.attach`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from tierkv.errors import InvalidInputError, InvalidTypeError, UnknownNameError
from tierkv.keys import is_content
from tierkv.page_sums import PageCheck
from tierkv.runtime import Arena, Event, Priority, TransferEngine, TransferHandle

__all__ = [
    "Batch",
    "Holds",
    "MoveHandler",
    "Moves",
    "Target",
    "Tier",
    "UnknownMoveError",
    "copy_move",
]


class Holds(enum.Enum):
    """What a tier may hold."""

    ANY = "any"  # any page: a live sequence's private pages too
    CONTENT = "content"  # content-keyed full blocks only (shareable, immutable, restartable)

    def accepts(self, key: bytes) -> bool:
        """Whether a page of this key may be held."""
        return self is Holds.ANY or is_content(key)


@runtime_checkable
class Tier(Protocol):
    """One tier of the chain: its medium, its rule of what it holds, and its slots.

    ``reserve`` / ``commit`` / ``abort`` / ``free`` are the two-phase slot protocol of the
    medium (a reservation is made findable by ``commit`` only once its write succeeded);
    ``lookup`` answers, without I/O, which keys it holds. Reads and writes of its slots are
    never called by the core directly: they run as jobs of the moves registered for its
    medium (`Moves`).
    """

    @property
    def medium(self) -> str:
        """The medium's name, the key of its moves in `Moves` (``"disk"``...)."""
        ...

    @property
    def holds(self) -> Holds:
        """What the tier may hold."""
        ...

    def accepts(self, key: bytes) -> bool:
        """Whether the tier may hold a page of this key."""
        ...

    def lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether the tier holds a committed page of it (no I/O)."""
        ...

    def admit(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key of a page evicted from the tier above (and not held here), whether to
        write it: the tier's admission filter (all True without one; a class deriving from
        `Tier` inherits that). Called once per offer: a filter may count the offers."""
        return [True] * len(keys)

    def reserve(self, keys: Sequence[bytes]) -> list[Any]:
        """Reserve a slot per key for a write (the medium's reservation records)."""
        ...

    def commit(self, reserved: Sequence[Any], ok: Sequence[bool]) -> None:
        """Make the reservations whose write succeeded findable; return the others' slots."""
        ...

    def abort(self, reserved: Sequence[Any]) -> None:
        """Return reserved slots unused."""
        ...

    def free(self, keys: Sequence[bytes]) -> int:
        """Drop keys (the chain's eviction); returns how many were held."""
        ...

    def make_room(self, n: int) -> int:
        """Free slots until ``n`` are free, by the tier's own order; returns the pages freed."""
        ...

    def stats(self) -> dict[str, Any]:
        """The tier's counters (plain values: they go to ``KVStore.stats()``)."""
        ...

    def close(self) -> None:
        """Release the medium (idempotent)."""
        ...


@dataclass(frozen=True, slots=True)
class Batch:
    """The pages of one move, as its handler gets them: ``keys``, one per page; ``arena`` and
    ``slots`` (one per key, in order) the core's end of the move (the source of a write into a
    tier, the destination of a read from one; between two arenas of the core, the source);
    ``sums``: the pages' checksums as the page table knows them, for a move that declares them
    to the other end (empty: none known, or checksums off); ``check``: for a read, the record
    the move fills with the checksums of the pages it verified and the pages that failed (None:
    the move's medium verifies by itself, or nothing to report)."""

    keys: Sequence[bytes]
    arena: Arena
    slots: Sequence[int]
    sums: Sequence[int] = ()
    check: PageCheck | None = None


#: A move: (engine, the other end, the batch) -> the handle of the one engine job it queued.
#: Between two arenas of the tier core the other end is the destination's `Target` and the
#: batch's arena the source's; for a lower `Tier` (or the remote tier) it is the tier, and the
#: batch's arena the host's (the source of a write into the tier, the destination of a read).
MoveHandler = Callable[[TransferEngine, Any, Batch], TransferHandle]


@dataclass(frozen=True, slots=True)
class Target:
    """The destination of a move between two arenas of the tier core: the arena, its slots (one
    per page, in the order of the keys), the job's priority and what it must wait for (the
    compute that wrote a page about to be written back)."""

    arena: Arena
    slots: Sequence[int]
    priority: Priority = Priority.DEMAND
    after: Sequence[Event | TransferHandle] = ()


def copy_move(engine: TransferEngine, target: Target, batch: Batch) -> TransferHandle:
    """The move between two arenas of one slot size (device <-> host): one engine copy of
    ``batch.arena[batch.slots]`` into ``target.arena[target.slots]``, bit-identical."""
    return engine.submit(
        batch.arena,
        batch.slots,
        target.arena,
        target.slots,
        priority=target.priority,
        after=target.after,
    )


class UnknownMoveError(UnknownNameError):
    """No move is registered for that pair of media."""


class Moves:
    """The registry of move handlers, keyed by (source medium, destination medium)."""

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], MoveHandler] = {}

    def register(self, source: str, dest: str, handler: MoveHandler) -> None:
        """Register the move from ``source`` to ``dest``. Raises InvalidTypeError (not
        callable, a name not a str), InvalidInputError (the pair is registered already, or
        source equals dest)."""
        for name in (source, dest):
            if not isinstance(name, str) or not name:
                raise InvalidTypeError(f"a medium is a non-empty str, got {name!r}")
        if not callable(handler):
            raise InvalidTypeError(f"a move handler must be callable, got {handler!r}")
        if source == dest:
            raise InvalidInputError(f"a move needs two media, got {source!r} twice")
        if (source, dest) in self._handlers:
            raise InvalidInputError(f"a move {source} -> {dest} is registered already")
        self._handlers[(source, dest)] = handler

    def get(self, source: str, dest: str) -> MoveHandler:
        """The handler of the move; raises UnknownMoveError when none is registered."""
        try:
            return self._handlers[(source, dest)]
        except KeyError:
            known = ", ".join(f"{s}->{d}" for s, d in sorted(self._handlers)) or "none"
            raise UnknownMoveError(
                f"no move registered from {source!r} to {dest!r} (registered: {known})"
            ) from None

    def has(self, source: str, dest: str) -> bool:
        """Whether a move is registered for the pair."""
        return (source, dest) in self._handlers

    def pairs(self) -> list[tuple[str, str]]:
        """The registered pairs, sorted."""
        return sorted(self._handlers)
