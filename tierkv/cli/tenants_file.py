"""The ``--tenants`` file of ``tierkv serve``: per-tenant page-server secrets, ``NAME HEX`` a
line (``#`` comments), readable by its owner only, read with bounds (a regular file of at most
``MAX_TENANTS_FILE`` bytes of UTF-8: a FIFO, a device, a huge or binary file is refused
before the server starts)."""

from __future__ import annotations

import os
import stat

from tierkv.errors import InvalidInputError, TenantError
from tierkv.tenant_names import check_tenant

__all__ = ["MAX_TENANTS_FILE", "read_tenants"]

#: the largest ``--tenants`` file read (bytes): ~10,000 tenants of 64-character names and
#: 32-byte secrets
MAX_TENANTS_FILE = 1 << 20


def read_tenants(path: str) -> dict[str, bytes]:
    """The tenants' secrets of a ``--tenants`` file: ``NAME HEX`` a line, ``#`` comments.

    Raises ValueError (InvalidInputError, TenantError): the file cannot be read, is not a
    regular file (a FIFO would block the start), is over ``MAX_TENANTS_FILE`` bytes or not
    UTF-8, group or others may read it, a line that is not a name and a hex secret, a name
    twice.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO: no wait for a writer)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidInputError(f"--tenants {path}: not a regular file")
            if st.st_mode & 0o077:
                raise InvalidInputError(
                    f"--tenants {path}: group or others may read it (chmod 600)"
                )
            raw = f.read(MAX_TENANTS_FILE + 1)
    except OSError as exc:
        raise InvalidInputError(f"--tenants: cannot read {path}: {exc.strerror}") from exc
    if len(raw) > MAX_TENANTS_FILE:
        raise InvalidInputError(f"--tenants {path}: over {MAX_TENANTS_FILE} bytes")
    try:
        lines = raw.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"--tenants {path}: not UTF-8 text") from exc
    out: dict[str, bytes] = {}
    for n, line in enumerate(lines, 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise InvalidInputError(
                f"--tenants {path}:{n}: want 'NAME HEX', got {len(words)} words"
            )
        try:
            name = check_tenant(words[0])
        except TenantError as exc:
            raise TenantError(f"--tenants {path}:{n}: {exc}") from exc
        if name in out:
            raise InvalidInputError(f"--tenants {path}:{n}: tenant {name!r} twice")
        try:
            out[name] = bytes.fromhex(words[1])
        except ValueError as exc:
            raise InvalidInputError(f"--tenants {path}:{n}: the secret is not hex") from exc
    return out
