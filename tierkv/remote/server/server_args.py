"""The page server's numbers and transports, checked at construction (before anything binds,
shares or allocates): a careless caller's NaN lease, negative timeout or empty transport list
was taken as given and failed later (a hello task's IndexError, timers that never fire, a
lease no client accepts)."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv import validate
from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.remote.protocol.wire import MAX_LEASE_TTL


def check_server_args(
    *,
    transports: object,
    port: object,
    lease_ttl: object,
    timeout: object,
    directory_ttl: object,
    max_writing: object,
    watch_pending: object,
    limits: dict[str, object],
    refused_hold: object,
) -> None:
    """Raise InvalidTypeError / InvalidInputError for a bad argument of `PageServer`.

    ``limits``: the connection budgets by name (``max_conns_per_peer``, ``max_preauth_per_peer``,
    ``max_preauth``: ints >= 1; ``max_preauth_failures``: None or an int >= 1;
    ``max_refused_held``: an int >= 0)."""
    if isinstance(transports, str | bytes) or not isinstance(transports, Sequence):
        raise InvalidTypeError(
            f"transports: a list of transport names, got {type(transports).__name__}"
        )
    if not transports or not all(isinstance(k, str) for k in transports):
        raise InvalidInputError(f"transports must name at least one transport, got {transports!r}")
    if validate.count("port", port, 0) > 65535:
        raise InvalidInputError(f"port must be in [0, 65535], got {port}")
    if validate.seconds("lease_ttl", lease_ttl) > MAX_LEASE_TTL:
        raise InvalidInputError(
            f"lease_ttl must be at most {MAX_LEASE_TTL:g} s (clients refuse longer), "
            f"got {lease_ttl}"
        )
    validate.seconds("timeout", timeout)
    validate.seconds("directory_ttl", directory_ttl)
    if max_writing is not None:
        validate.count("max_writing", max_writing, 0)
    validate.count("watch_pending", watch_pending, 1)
    for name, value in limits.items():
        if value is None and name == "max_preauth_failures":
            continue
        validate.count(name, value, 0 if name == "max_refused_held" else 1)
    if refused_hold is not None:
        validate.seconds("refused_hold", refused_hold, allow_zero=True)
