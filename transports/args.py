"""Checks of a transport's constructor arguments (every backend's timeout, tcp's and shm's
secret), typed, before anything starts."""

from __future__ import annotations

from .errors import InvalidInputError, InvalidTypeError

__all__ = ["MAX_TIMEOUT_S", "check_secret", "check_timeout"]

MAX_TIMEOUT_S = 1e9
"""The longest timeout a transport takes (a thread wait past ``threading.TIMEOUT_MAX`` raises
OverflowError; a NaN bound nothing)."""


def check_timeout(timeout: object) -> float:
    """A transport's timeout: a finite number of seconds in (0, MAX_TIMEOUT_S]. Raises
    InvalidTypeError, InvalidInputError."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise InvalidTypeError(f"timeout: seconds as a number, got {type(timeout).__name__}")
    if not 0 < timeout <= MAX_TIMEOUT_S:  # (NaN too)
        raise InvalidInputError(f"timeout must be in (0, {MAX_TIMEOUT_S:g}] s, got {timeout!r}")
    return float(timeout)


def check_secret(secret: object) -> bytes | None:
    """A transport's ``secret``: bytes (a bytearray or memoryview as bytes), or None. Raises
    InvalidTypeError (a str secret was taken and failed at the first handshake)."""
    if secret is None or isinstance(secret, bytes):
        return secret
    if isinstance(secret, bytearray | memoryview):
        return bytes(secret)
    raise InvalidTypeError(f"a secret is bytes, got {type(secret).__name__}")
