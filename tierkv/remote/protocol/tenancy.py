"""Tenants of a page server: whose secret a session proved, and the keys its pages live under.

A client names its tenant in the handshake's auth frame (``"tenant"``); the server proves the
client against that tenant's secret (transports.session: a tenant it does not know is refused
exactly as a wrong secret is). From then on every key the session names is mapped to the key
the tenant's page lives under on the server::

    stored key = BLAKE2b(key = HMAC-SHA256(tenant secret, "tierkv-tenant-keys/v1" | tenant),
                         data = key, digest_size = len(key))    content bit kept

so two tenants' identical prompts are two pages, a session can only name its own tenant's
pages (another tenant's look exactly like pages nobody holds), and a key in the cluster
directory tells nobody without the tenant's secret which prompt it stands for. The client
computes the same (`TenantKeys`) to find its pages in the directory. Without a tenant (the
default secret), keys are used as they are.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Any

from tierkv.errors import InvalidInputError, TenantError
from tierkv.remote.protocol.exposure import warn_if_short
from tierkv.tenant_names import check_distinct, check_tenant

__all__ = ["TENANT_FIELD", "TenantKeys", "check_secrets"]

#: the auth frame's field that names the client's tenant
TENANT_FIELD = "tenant"
_LABEL = b"tierkv-tenant-keys/v1"
_PRIVATE_BIT = 0x80  # tierkv.keys: set in a private key's first byte


class TenantKeys:
    """The keys one tenant's pages live under on page servers (see the module docstring)."""

    __slots__ = ("_bases", "_key", "tenant")

    def __init__(self, tenant: str, secret: bytes) -> None:
        self.tenant = tenant
        self._key = hmac.new(secret, _LABEL + tenant.encode(), hashlib.sha256).digest()
        self._bases: dict[int, Any] = {}  # digest size -> the keyed hash, copied per key

    def key(self, key: bytes) -> bytes:
        """The key page ``key`` of this tenant lives under (as long as ``key``, 1-64 bytes;
        a content key stays a content key, a private one private); a key of another length,
        which no page server takes, as it is."""
        n = len(key)
        if not 1 <= n <= 64:
            return key
        base = self._bases.get(n)
        if base is None:
            base = self._bases[n] = hashlib.blake2b(digest_size=n, key=self._key)
        h = base.copy()  # a third cheaper than keying a new one
        h.update(key)
        out = h.digest()
        if (out[0] ^ key[0]) & _PRIVATE_BIT:  # keep the key's content / private bit
            out = bytes((out[0] ^ _PRIVATE_BIT,)) + out[1:]
        return out

    def keys(self, keys: list[bytes]) -> list[bytes]:
        """`key` of each."""
        return [self.key(k) for k in keys]


def check_secrets(secrets: Mapping[str, bytes] | None, default: bytes) -> dict[str, bytes]:
    """Per-tenant secrets, checked: names (`check_tenant`), non-empty bytes, and no secret
    that another tenant or the default (``default``) also has, so a proof names one tenant.

    Raises:
        TenantError: a bad tenant name, or a secret that is not bytes.
        InvalidInputError: an empty secret, or one shared.
    """
    if secrets is None:
        return {}
    if not isinstance(secrets, Mapping):
        raise TenantError(f"secrets must map tenant names to bytes, got {type(secrets).__name__}")
    out: dict[str, bytes] = {}
    seen = {default} if default else set()
    for name, secret in secrets.items():
        tenant = check_tenant(name)
        if not isinstance(secret, bytes):
            raise TenantError(f"the secret of tenant {tenant!r} must be bytes")
        if not secret:
            raise InvalidInputError(f"tenant {tenant!r}: an empty secret is not a secret")
        if secret in seen:
            raise InvalidInputError(
                f"tenant {tenant!r} has a secret that another tenant (or the default) has too: "
                "a proof would not say which tenant it is"
            )
        seen.add(secret)
        warn_if_short(secret, f"tenant {tenant!r}'s secret")
        out[tenant] = secret
    check_distinct(out)
    return out
