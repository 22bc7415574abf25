"""What the directory's server answers, checked before it is believed: the live set, the
LOCATE scripts' replies (`redis_directory`), and the bounds of a trip's bytes and aggregates
on the directory's own connections (`wire`). A reply of any other shape is
``redis.exceptions.InvalidResponse`` (a RedisError, which the directory's callers count and
ride out), never a TypeError, IndexError or MemoryError from deep inside a parse."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Any

from redis.exceptions import InvalidResponse, ResponseError

from tierkv.errors import InvalidInputError
from tierkv.remote.protocol.control import split_address

__all__ = [
    "MAX_ADDRESS",
    "MAX_ELEMENTS",
    "AggregateGuard",
    "check_address",
    "counted",
    "entry_refused",
    "live_set",
    "node_numbers",
    "registered",
    "script_reply",
    "suspect",
]

MAX_ELEMENTS = 10**6
"""Elements an aggregate reply may announce (hiredis allocates the announced count at once:
``*4294967295`` alone asked for 32 GiB). The live set is the largest, two per live node."""

_BULK = frozenset(b"$=!")  # a length, then that many bytes (and CRLF)
_AGGREGATE = frozenset(b"*~>%|")  # a count of elements (pairs for % and |)


def suspect(data: bytes | bytearray) -> bool:
    """Whether ``data`` holds what could be the header of an aggregate of ``MAX_ELEMENTS`` or
    more: a type byte, then 7 digits or as many as there are before its end (a payload's
    bytes may match too; `AggregateGuard` then decides). C-speed finds of the five type
    bytes (12 us for a 1,000-key locate's replies; a regex took 60)."""
    for kind in _AGGREGATE:
        at = data.find(kind)
        while at >= 0:
            if data[at + 1 : at + 8].lstrip(b"-").isdigit():
                return True
            at = data.find(kind, at + 1)
    return False


_HEADER_BYTES = 32
"""The longest length or count line (a type byte, a sign, up to 20 digits, CRLF): a longer
one is no RESP."""


class AggregateGuard:
    """Walks a RESP stream from its start, header by header, skipping bulk payloads (counted,
    never buffered), and raises InvalidResponse at an aggregate header announcing more than
    `MAX_ELEMENTS`, a bulk header announcing more than ``max_bulk`` bytes (None: any), or a
    length that is no number (before the parser sees any of them). Only the headers' framing
    matters here, not the nesting; a malformed simple line is left to the parser, which
    refuses it. Resumable: `feed` walks the new bytes only (a Python step per header).

    The directory's own connections walk a trip with it once `suspect` matched (`wire`); a
    redis-py connection walks every byte it reads (`tierkv.remote.membership.bounded`)."""

    def __init__(self, max_bulk: int | None = None) -> None:
        self.max_bulk = max_bulk
        # the current line so far: a length or count line's bytes; of any other line, its
        # type byte and its last byte (a CR, if its CRLF is split between two feeds)
        self._line = bytearray()
        self._skip = 0  # a bulk's payload bytes (and CRLF) still to pass

    def feed(self, data: bytes | bytearray) -> None:
        """Walk ``data`` (the stream's next bytes)."""
        line, pos, n = self._line, 0, len(data)
        while pos < n:
            if self._skip:
                step = min(self._skip, n - pos)
                self._skip -= step
                pos += step
                continue
            if line[-1:] == b"\r" and data[pos] == 10:  # a CRLF split between two feeds
                del line[-1]
                pos += 1
                self._header()
                continue
            end = data.find(b"\r\n", pos)
            self._part(data, pos, n if end < 0 else end)
            if end < 0:
                break
            pos = end + 2
            self._header()

    def _part(self, data: bytes | bytearray, pos: int, end: int) -> None:
        """Add ``data[pos:end]`` to the current line (only what `_header` needs of it)."""
        line = self._line
        if pos == end:
            return
        kind = line[0] if line else data[pos]
        if kind in _BULK or kind in _AGGREGATE:
            line += data[pos:end]
            if len(line) > _HEADER_BYTES:
                raise InvalidResponse(f"a length line of over {_HEADER_BYTES} bytes: {line!r:.40}")
        else:
            line[:] = bytes((kind, data[end - 1]))  # (an endless line costs no memory here)

    def _header(self) -> None:
        """The current line is complete: check it (a length or a count) and clear it."""
        line = self._line
        kind = line[0] if line else 0
        if kind in _BULK or kind in _AGGREGATE:
            try:
                n = int(line[1:])
            except ValueError:
                raise InvalidResponse(f"not RESP: a length of {bytes(line)!r:.40}") from None
            if kind in _AGGREGATE and n > MAX_ELEMENTS:
                raise InvalidResponse(
                    f"an aggregate reply of {n} elements (at most {MAX_ELEMENTS})"
                )
            if kind in _BULK and n >= 0:
                if self.max_bulk is not None and n > self.max_bulk:
                    raise InvalidResponse(f"a bulk reply of {n} bytes (at most {self.max_bulk})")
                self._skip = n + 2
        line.clear()


MAX_ADDRESS = 262
"""Longest node address registered: a 253-character host name, brackets, ``:65535``."""


def check_address(address: str) -> None:
    """Raise InvalidTypeError / InvalidInputError unless ``address`` is ``host:port`` (port in
    [1, 65535]) of at most `MAX_ADDRESS` characters."""
    split_address(address)
    if len(address) > MAX_ADDRESS:
        raise InvalidInputError(f"a node address of {len(address)} characters: {address!r:.40}")


def _live_entry(number: Any, address: Any) -> tuple[int, str] | None:
    """One entry of the live set as (number, address); None when it is no entry tierkv writes
    (a number not in [0, 2**32), an address no client could reach)."""
    n = _int(number)
    if n is None or not 0 <= n < 1 << 32 or not isinstance(address, bytes):
        return None
    try:
        a = address.decode()
        check_address(a)
    except (UnicodeDecodeError, InvalidInputError):
        return None
    return n, a


def live_set(flat: Any) -> tuple[dict[int, str], int]:
    """The LIVE script's reply (number, address, number, address...) as number -> address, and
    how many entries were left out: a number or an address tierkv never registers (written
    into Redis by another writer, hostile or older: ``""``, ``h:0``, 100 KB, not UTF-8) is
    never answered (clients refused it, yet it was tried ahead of a good holder each time).
    Raises it when it is an error reply, InvalidResponse when it is no flat list of pairs."""
    if isinstance(flat, Exception):
        raise flat
    if not isinstance(flat, list) or len(flat) % 2:
        raise _not_live(flat)
    live: dict[int, str] = {}
    for i in range(0, len(flat), 2):
        entry = _live_entry(flat[i], flat[i + 1])
        if entry is not None:
            live[entry[0]] = entry[1]
    return live, len(flat) // 2 - len(live)


def entry_refused(value: Any) -> bool:
    """Whether ``value``, one key's reply to HGET, is an entry tierkv never writes, left out
    as no holders: bytes that are no whole number of node numbers (uint32 each), or a bucket
    that is no hash (WRONGTYPE). Any other error reply is raised; any other non-bytes reply
    is InvalidResponse (no Redis answers an HGET so)."""
    if isinstance(value, bytes):
        return len(value) % 4 != 0
    if isinstance(value, ResponseError) and str(value).startswith("WRONGTYPE"):
        return True
    if isinstance(value, Exception):
        raise value
    raise InvalidResponse(f"not a directory entry: {value!r:.80}")


def _not_live(flat: Any) -> InvalidResponse:
    return InvalidResponse(f"not the directory's live set: {flat!r:.80}")


def script_reply(r: Any) -> tuple[bytes, bytes, int]:
    """A LOCATE script's reply: holder counts (uint16 LE each), holders (uint32 LE each), as
    many holders as the counts add up to, and how many entries the script left out (values
    tierkv never writes). Raises InvalidResponse otherwise."""
    if isinstance(r, Exception):
        raise r
    ok = isinstance(r, list) and len(r) == 3 and all(isinstance(x, bytes) for x in r[:2])
    refused = _int(r[2]) if ok else None
    if refused is None or refused < 0 or len(r[0]) % 2 or len(r[1]) % 4:
        raise InvalidResponse(f"not a locate reply: {r!r:.80}")
    counts, held = r[0], r[1]
    if sum(struct.unpack(f"<{len(counts) // 2}H", counts)) != len(held) // 4:
        raise InvalidResponse(f"a locate reply whose counts and holders differ: {r!r:.80}")
    return counts, held, refused


def _int(x: Any) -> int | None:
    """An integer reply (or a set member's digits) as an int; None for anything else."""
    if type(x) is int:
        return x
    if isinstance(x, bytes) and x.lstrip(b"-").isdigit() and len(x) <= 20:
        return int(x)
    return None


def node_numbers(members: Any, what: str) -> list[int]:
    """Node numbers (ints in [0, 2**32): each is packed as a uint32) from a set's members or a
    script; InvalidResponse for anything else (a member of ``99999999999`` packed raised
    OverflowError in the sweeper)."""
    if isinstance(members, Exception):
        raise members
    numbers = [_int(x) for x in members or []] if isinstance(members, list | None) else [None]
    if not all(n is not None and 0 <= n < 1 << 32 for n in numbers):
        raise InvalidResponse(f"{what} holds {members!r:.80}, not node numbers")
    return numbers  # type: ignore[return-value]


def registered(reply: Any) -> tuple[int, int]:
    """The REGISTER script's reply: (our new number, or < 0 while the address is held; ms
    until the holder lapses). InvalidResponse for anything else (unpacked as it came, a
    hostile reply was a TypeError, a huge number an OverflowError at the next publish)."""
    if isinstance(reply, Exception):
        raise reply
    got = [_int(x) for x in reply] if isinstance(reply, list) and len(reply) == 2 else []
    if len(got) != 2 or got[0] is None or got[1] is None or got[0] >= 1 << 32:
        raise InvalidResponse(f"not a register reply: {reply!r:.80}")
    return got[0], got[1]


def counted(replies: Iterable[Any], what: str) -> int:
    """The sum of scripts' counts (ints >= 0); InvalidResponse for anything else."""
    total = 0
    for r in replies:
        if isinstance(r, Exception):
            raise r
        n = _int(r)
        if n is None or n < 0:
            raise InvalidResponse(f"not a count of {what}: {r!r:.80}")
        total += n
    return total
