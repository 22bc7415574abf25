"""The serving engine's errors, and the HTTP status that stands for each tierkv error.

::

    TierKVError
     └── ServingError                          the serving engine's own
          ├── RequestError (also InvalidInputError, a ValueError)
          │    │                               a request that can never run: empty, ids out of
          │    │                               the vocabulary, too long for the context or the
          │    │                               device tier
          │    └── ContextLengthError          too long: prompt + max_tokens over the context
          │                                    or the device tier's pages (OpenAI's code
          │                                    ``context_length_exceeded``)
          ├── EngineNotOpenError (also RuntimeError)
          │                                    a request to an engine not open (or closed)
          └── EngineBusyError                  ``max_waiting`` requests wait already: try
                                               again later (a 503)

Everything else a request can meet is a tierkv error too (a bad sampling parameter is an
:class:`~tierkv.errors.InvalidInputError`, a failed step the store's error); an HTTP layer in
front of the engine answers each with :func:`http_status`.
"""

from __future__ import annotations

from tierkv.errors import (
    InvalidInputError,
    QuotaExceededError,
    StoreClosedError,
    StoreTimeoutError,
    TierFullError,
    TierKVError,
    UnknownNameError,
)

__all__ = [
    "ContextLengthError",
    "EngineBusyError",
    "EngineNotOpenError",
    "RequestError",
    "ServingError",
    "http_status",
]


class ServingError(TierKVError):
    """Root of the serving engine's own errors."""


class RequestError(ServingError, InvalidInputError):
    """A request that can never run: empty, too long for the context or the device tier. Also
    a ``ValueError`` (as it always was)."""


class ContextLengthError(RequestError):
    """A request too long to run: its prompt and ``max_tokens`` exceed the context, or need
    more pages than the device tier allows (the other RequestErrors are not about length)."""


class EngineNotOpenError(ServingError, RuntimeError):
    """A request to an engine that is not open, or closed already."""


class EngineBusyError(ServingError):
    """A request refused because ``EngineConfig.max_waiting`` requests are waiting already."""


# first match wins: the more specific kinds first
_STATUS: tuple[tuple[type[TierKVError], int], ...] = (
    (InvalidInputError, 400),  # RequestError, a bad sampling parameter, an unknown policy
    (UnknownNameError, 400),  # an unknown codec or backend name is the caller's too
    (EngineNotOpenError, 503),
    (EngineBusyError, 503),  # the queue is full: come back later
    (StoreClosedError, 503),
    (QuotaExceededError, 429),  # no room within the tenant's quota: too many requests
    (TierFullError, 503),  # every device page is pinned: come back later
    (StoreTimeoutError, 504),
)


def http_status(exc: TierKVError) -> int:
    """The HTTP status that answers ``exc``: 400 for the caller's mistakes (bad input, unknown
    names), 503 for a server that cannot take it now (closed, not open, full), 504 for a
    bounded wait that ran out, 500 for any other failure."""
    for kind, status in _STATUS:
        if isinstance(exc, kind):
            return status
    return 500
