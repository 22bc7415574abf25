"""Background failures: counted where they happen, and logged to the ``tierkv`` logger.

A failure that no caller sees (a prefetch, compression or write-behind task of the store, a
read of the remote tier, a push to it, a request's release in the serving engine) is kept as a
counter and the last error string of its owner's counters, and reported here to
:mod:`logging` as well: one ``WARNING`` record with the kind, the tier and the page keys, and
the exception (``exc_info``). The records are rate limited per kind: at most one each
``interval`` seconds; the next record says how many of that kind were left out meanwhile::

    tierkv.store: background write-behind failed on tier host for 3 pages [0a1b..., ...]:
                  TransferFailedError: ... (2 more write-behind failures not logged in 10 s)

A log made with ``tracebacks=False`` (the directory's: an unreachable Redis is an operator's
state, not a bug, and its retries would print a page of redis-py frames each) writes the
``WARNING`` as one line and the traceback in a ``DEBUG`` record after it, sent only when the
logger is enabled for ``DEBUG``.

Each record also carries its fields for filters and handlers: ``record.tierkv_kind``,
``record.tierkv_tier``, ``record.tierkv_keys`` (hex strings) and ``record.tierkv_suppressed``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["LOG_INTERVAL_S", "Background", "FailureLog", "describe"]

LOG_INTERVAL_S = 10.0
"""At most one record per kind of failure in this many seconds (per :class:`FailureLog`)."""

_SHOWN_KEYS = 4  # keys written into the message; the record's tierkv_keys has them all


def describe(exc: BaseException) -> str:
    """The one-line form of ``exc`` kept as a counter's ``last_error``."""
    return f"{type(exc).__name__}: {exc}"


@dataclass(slots=True)
class Background:
    """What a background task works on, for the report of its failure: the task fills in
    ``keys`` once it knows them."""

    kind: str
    tier: str | None = None
    keys: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class _Window:
    next_at: float = 0.0  # the earliest time the next record of this kind may go out
    suppressed: int = 0  # failures of this kind left out since the last record


class FailureLog:
    """Reports background failures to the logger ``name``, rate limited per kind.

    Args:
        name: the logger, ``"tierkv"`` or below it (``"tierkv.store"``, ...).
        interval: at most one record per kind in this many seconds.
        clock: monotonic seconds (tests give their own).
        tracebacks: the ``WARNING`` carries the exception's traceback (``exc_info``); False:
            one line, the traceback in a ``DEBUG`` record of its own.
    """

    def __init__(
        self,
        name: str = "tierkv",
        *,
        interval: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        tracebacks: bool = True,
    ) -> None:
        self.logger = logging.getLogger(name)
        self.tracebacks = tracebacks
        self.interval = interval
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def report(
        self,
        kind: str,
        exc: BaseException,
        *,
        tier: str | None = None,
        keys: Sequence[bytes] = (),
    ) -> str:
        """Log the failure ``exc`` of ``kind`` on ``tier`` for the pages ``keys`` (unless a
        record of ``kind`` went out less than ``interval`` seconds ago: then it is counted and
        named by the next one). Returns :func:`describe` of ``exc`` for the owner's counter."""
        text = describe(exc)
        if not self.logger.isEnabledFor(logging.WARNING):
            return text
        now = self._clock()
        window = self._windows.setdefault(kind, _Window())
        if now < window.next_at:
            window.suppressed += 1
            return text
        suppressed, window.suppressed = window.suppressed, 0
        window.next_at = now + self.interval
        hexes = [k.hex() for k in keys]
        shown = ", ".join(hexes[:_SHOWN_KEYS]) + (", ..." if len(hexes) > _SHOWN_KEYS else "")
        where = f" on tier {tier}" if tier else ""
        pages = f" for {len(hexes)} pages [{shown}]" if hexes else ""
        more = (
            f" ({suppressed} more {kind} failures not logged in {self.interval:g} s)"
            if suppressed
            else ""
        )
        trace = (type(exc), exc, exc.__traceback__)
        extra = {
            "tierkv_kind": kind,
            "tierkv_tier": tier,
            "tierkv_keys": hexes,
            "tierkv_suppressed": suppressed,
        }
        self.logger.warning(
            "background %s failed%s%s: %s%s",
            kind,
            where,
            pages,
            text,
            more,
            exc_info=trace if self.tracebacks else None,
            extra=extra,
        )
        if not self.tracebacks and self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug("the traceback of background %s", kind, exc_info=trace, extra=extra)
        return text
