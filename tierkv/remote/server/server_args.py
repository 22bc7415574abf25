"""The page server's numbers and transports, checked at construction (before anything binds,
shares or allocates): a careless caller's NaN lease, negative timeout or empty transport list
was taken as given and failed later (a hello task's IndexError, timers that never fire, a
lease no client accepts)."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv import validate
from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.remote.protocol.wire import MAX_LEASE_TTL

#: the least each count may be (None: no bound, where a count may be None)
_LEAST = {
    "max_writing": 0,
    "watch_pending": 1,
    "max_conns_per_peer": 1,
    "max_preauth_per_peer": 1,
    "max_preauth": 1,
    "max_preauth_failures": 1,
    "max_refused_held": 0,
}
_MAY_BE_NONE = frozenset({"max_writing", "max_preauth_failures"})


def check_server_args(
    transports: object,
    port: object,
    seconds: dict[str, object],
    counts: dict[str, object],
    refused_hold: object,
) -> None:
    """Raise InvalidTypeError / InvalidInputError for a bad argument of `PageServer`:
    ``seconds`` by name (finite, > 0; ``lease_ttl`` at most MAX_LEASE_TTL), ``counts`` by
    name (ints at least `_LEAST`'s; None where `_MAY_BE_NONE`), ``refused_hold`` (None or
    seconds >= 0)."""
    if isinstance(transports, str | bytes) or not isinstance(transports, Sequence):
        raise InvalidTypeError(
            f"transports: a list of transport names, got {type(transports).__name__}"
        )
    if not transports or not all(isinstance(k, str) for k in transports):
        raise InvalidInputError(f"transports must name at least one transport, got {transports!r}")
    if validate.count("port", port, 0) > 65535:
        raise InvalidInputError(f"port must be in [0, 65535], got {port}")
    for name, value in seconds.items():
        if validate.seconds(name, value) > MAX_LEASE_TTL and name == "lease_ttl":
            raise InvalidInputError(
                f"lease_ttl must be at most {MAX_LEASE_TTL:g} s (clients refuse longer), "
                f"got {value}"
            )
    for name, value in counts.items():
        if value is None and name in _MAY_BE_NONE:
            continue
        validate.count(name, value, _LEAST[name])
    if refused_hold is not None:
        validate.seconds("refused_hold", refused_hold, allow_zero=True)
