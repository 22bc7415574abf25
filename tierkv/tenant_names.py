"""Tenant names and cache salts, checked once at entry.

A **tenant** is a name an operator configures (quotas, a page-server secret, a Redis key
prefix an ACL can match). A **salt** is an opaque value a request carries (vLLM's
``cache_salt``) that is mixed into the first block's content key, so that two salts never share
a page in any tier. Both are checked here, the same way everywhere they enter.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

from tierkv.errors import InvalidTypeError, TenantError

#: Longest tenant name (characters). Names appear in Redis keys and metric labels.
MAX_TENANT_CHARS = 64
#: Longest salt, in bytes after UTF-8 encoding.
MAX_SALT_BYTES = 256

_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_tenant(name: object) -> str:
    """``name`` if it is a valid tenant name: a ``str`` of 1-64 characters from
    ``[A-Za-z0-9_.-]``, starting with a letter or digit.

    Raises:
        InvalidTypeError: not a ``str`` (a ``TenantError`` too).
        TenantError: empty, too long, or a character outside the set.
    """
    if not isinstance(name, str):
        raise _TenantTypeError(f"tenant must be a str, got {type(name).__name__}")
    if not name or len(name) > MAX_TENANT_CHARS:
        raise TenantError(f"tenant name must have 1-{MAX_TENANT_CHARS} characters, got {len(name)}")
    if _TENANT_RE.fullmatch(name) is None:
        raise TenantError(f"tenant name {name!r} has characters outside [A-Za-z0-9_.-]")
    return name


def check_distinct(names: Iterable[str]) -> None:
    """Refuse a configuration naming two tenants that differ only in case (``acme`` and
    ``Acme``): names are exact, case-sensitive matches everywhere (quotas, secrets, Redis
    prefixes, metric labels), so such a pair is nearly always a typo that would split one
    customer into two tenants.

    Raises:
        TenantError: two names equal but for case.
    """
    seen: dict[str, str] = {}
    for n in names:
        other = seen.setdefault(n.casefold(), n)
        if other != n:
            raise TenantError(
                f"tenants {other!r} and {n!r} differ only in case: names are case-sensitive, "
                "give them distinct names"
            )


def case_hint(name: object, names: Iterable[str]) -> str:
    """``" (did you mean 'x'? tenant names are case-sensitive)"`` when ``name`` matches one
    of ``names`` but for case; else ``""`` (for an unknown-tenant error)."""
    if isinstance(name, str):
        folded = name.casefold()
        for n in names:
            if n.casefold() == folded:
                return f" (did you mean {n!r}? tenant names are case-sensitive)"
    return ""


def check_salt(salt: object) -> bytes | None:
    """The salt as bytes (``str`` is UTF-8 encoded), or ``None`` for no salt.

    Raises:
        InvalidTypeError: not ``str``, ``bytes`` or ``None`` (a ``TenantError`` too).
        TenantError: empty, or longer than ``MAX_SALT_BYTES`` bytes.
    """
    if salt is None:
        return None
    if isinstance(salt, str):
        raw = salt.encode("utf-8", "surrogatepass")
    elif isinstance(salt, bytes):
        raw = salt
    else:
        raise _TenantTypeError(f"salt must be str or bytes, got {type(salt).__name__}")
    if not raw or len(raw) > MAX_SALT_BYTES:
        raise TenantError(f"salt must have 1-{MAX_SALT_BYTES} bytes, got {len(raw)}")
    return raw


class _TenantTypeError(TenantError, InvalidTypeError):
    """A tenant or salt of the wrong type."""


def tenant_salt(tenant: str, salt: bytes | None) -> bytes:
    """The cache salt of a request of ``tenant`` (checked) carrying ``salt`` (checked, or None):
    32 bytes, SHA-256 of a tag, the tenant and the salt (stable across processes). A server
    that knows each request's tenant (from its API key) salts with this, so that no page is
    shared across tenants whatever salt a client sends: a client cannot reach another
    tenant's pages by sending its salt, nor the unsalted ones by sending none. Requests of one
    tenant with the same salt (or both none) still share."""
    h = hashlib.sha256(b"tierkv tenant salt\x00")
    h.update(check_tenant(tenant).encode())  # (no NUL in a name: the parts cannot run together)
    h.update(b"\x00\x00" if salt is None else b"\x00\x01" + salt)
    return h.digest()
