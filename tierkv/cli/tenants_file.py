"""The ``--tenants FILE`` of ``tierkv serve``: per-tenant secrets, ``NAME HEX`` a line, ``#``
comments. The file holds secrets, so it must be a regular file that only its owner may read;
it is opened without blocking (a FIFO or a device is refused before a read could wait; a
symbolic link is followed, as secret mounts use them, and its target checked) and read up to
`MAX_BYTES`."""

from __future__ import annotations

import os
import stat

from tierkv.errors import InvalidInputError, TenantError
from tierkv.tenant_names import check_tenant

__all__ = ["MAX_BYTES", "read_tenants"]

MAX_BYTES = 1 << 20
"""A tenants file larger than this is refused (about 10,000 tenants of 64-byte secrets)."""


def _text(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidInputError(f"--tenants: cannot read {path}: {exc.strerror}") from exc
    except ValueError as exc:  # a NUL in the path
        raise InvalidInputError(f"--tenants: cannot read {path!r}: {exc}") from None
    try:  # checked before a file object is made (fdopen refuses a directory itself)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidInputError(f"--tenants {path}: not a regular file")
        if st.st_mode & 0o077:
            raise InvalidInputError(f"--tenants {path}: group or others may read it (chmod 600)")
        with os.fdopen(fd, "rb", closefd=False) as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise InvalidInputError(f"--tenants: cannot read {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if len(raw) > MAX_BYTES:
        raise InvalidInputError(f"--tenants {path}: larger than {MAX_BYTES} bytes")
    try:
        return raw.decode("utf-8-sig")  # (an editor's byte-order mark is no part of a name)
    except UnicodeDecodeError as exc:
        raise InvalidInputError(f"--tenants {path}: not UTF-8 text ({exc.reason})") from None


def read_tenants(path: str) -> dict[str, bytes]:
    """The tenants' secrets of a ``--tenants`` file: ``NAME HEX`` a line, ``#`` comments.

    Raises ValueError (InvalidInputError, TenantError): the file cannot be read, is not a
    regular file, is too large or not UTF-8, group or others may read it, a line that is not
    a name and a hex secret, a name twice.
    """
    out: dict[str, bytes] = {}
    for n, line in enumerate(_text(path).splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) != 2:
            raise InvalidInputError(
                f"--tenants {path}:{n}: want 'NAME HEX', got {len(words)} words"
            )
        try:
            name = check_tenant(words[0])
        except TenantError as exc:  # the line that holds it
            raise TenantError(f"--tenants {path}:{n}: {exc}") from exc
        if name in out:
            raise InvalidInputError(f"--tenants {path}:{n}: tenant {name!r} twice")
        try:
            out[name] = bytes.fromhex(words[1])
        except ValueError as exc:
            raise InvalidInputError(f"--tenants {path}:{n}: the secret is not hex") from exc
    return out
