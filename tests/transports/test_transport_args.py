"""A careless caller's transport arguments: typed errors at construction or at the call.

* A str secret was taken (tcp, shm) and failed at the first handshake; a NaN or negative
  timeout was taken, bounding nothing (a NaN) or failing every wait at once.
* A batch of anything but TransferOps was unpacked: a TypeError from inside.
"""

from __future__ import annotations

import pytest

import tierkv.transports as transports
from tierkv.transports.errors import InvalidInputError, InvalidTypeError

SECRET = b"transport-args-secret-32-bytes!!"


@pytest.mark.parametrize("kind", ["tcp", "shm"])
def test_a_str_secret_is_a_type_error(kind: str) -> None:
    with pytest.raises(InvalidTypeError, match="secret is bytes"):
        transports.create(kind, secret=SECRET.decode())


@pytest.mark.parametrize("kind", ["tcp", "shm", "loopback"])
@pytest.mark.parametrize("timeout", [float("nan"), -1.0, 0, 1e300, "5", True])
def test_a_bad_timeout_is_refused(kind: str, timeout: object) -> None:
    opts = {} if kind == "loopback" else {"secret": SECRET}
    with pytest.raises(InvalidInputError, match="timeout"):
        transports.create(kind, timeout=timeout, **opts)


async def test_a_batch_of_something_else_is_a_type_error() -> None:
    async with transports.create("tcp", secret=SECRET) as t:
        with pytest.raises(InvalidTypeError, match="TransferOps"):
            t.read([1, 2])  # type: ignore[list-item]
        with pytest.raises(InvalidTypeError, match="TransferOps"):
            t.write(["op"])  # type: ignore[list-item]
    assert transports.create("tcp", secret=bytearray(SECRET)).timeout > 0
