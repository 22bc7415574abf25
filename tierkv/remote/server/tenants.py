"""The page server's tenants: whose secret each session proves, the keys its requests map to,
and what each tenant did (protocol: tierkv.remote.protocol.tenancy; docs/security.md,
*Tenants*).

::

    auth frame {"tenant": "acme", ...} -> secret_of: acme's secret (None: unknown, refused)
    proved                             -> tenant_of: "acme" (the session's Peer.tenant)
    request keys                       -> keys("acme", keys): the keys acme's pages live under

Counters (``stats``, per tenant): sessions proved, auth refused (claims of the tenant whose
proof failed), pages served (acquired) and published (stored), bytes of each, and refusals
(requests answered with an error: full, expired, malformed). Claims of tenants nobody
configured are counted together (``unknown_tenant_refused_total``): a peer's made-up names
never become keys of a map.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tierkv.remote.protocol.tenancy import TENANT_FIELD, TenantKeys, check_secrets

__all__ = ["CACHED_KEYS", "COUNTERS", "ServerTenants"]

#: tenant keys remembered per tenant (the newest; ~200 bytes each): a load's lookup and
#: acquire, and the next loads of a prompt, derive each key once
CACHED_KEYS = 1 << 14

COUNTERS = (
    "sessions_total",
    "auth_refused_total",
    "served_pages_total",
    "served_bytes_total",
    "published_pages_total",
    "published_bytes_total",
    "refused_total",
)


class ServerTenants:
    """Per-tenant secrets (checked by `check_secrets`: none shared, none empty), keys and
    counters of one page server. ``default``: the secret of sessions that name no tenant."""

    def __init__(self, secrets: Mapping[str, bytes] | None, default: bytes) -> None:
        self.secrets = check_secrets(secrets, default)
        self.default = default
        self._keys = {t: TenantKeys(t, s) for t, s in self.secrets.items()}
        self._cache: dict[str, dict[bytes, bytes]] = {t: {} for t in self.secrets}
        self._claims = dict.fromkeys(self.secrets, 0)
        self._counts = {t: dict.fromkeys(COUNTERS, 0) for t in self.secrets}
        self.unknown = 0

    def __bool__(self) -> bool:
        return bool(self.secrets)

    def secret_of(self, auth: dict[str, Any]) -> bytes | None:
        """The secret the client of ``auth`` must prove: its tenant's, the default for none;
        None for a tenant we do not know (`transports.session` refuses it as a bad proof)."""
        name = auth.get(TENANT_FIELD)
        if name is None:
            return self.default
        secret = self.secrets.get(name) if isinstance(name, str) else None
        if secret is None:
            self.unknown += 1
            return None
        self._claims[name] += 1
        return secret

    def tenant_of(self, auth: dict[str, Any]) -> str | None:
        """The tenant of a client that proved `secret_of` (None: the default)."""
        name = auth.get(TENANT_FIELD)
        if not isinstance(name, str) or name not in self.secrets:
            return None
        self._counts[name]["sessions_total"] += 1
        return name

    def keys(self, tenant: str | None, keys: list[bytes]) -> list[bytes]:
        """The keys ``tenant``'s pages live under (the default's: ``keys`` themselves)."""
        if tenant is None:
            return keys
        cache, derive = self._cache[tenant], self._keys[tenant].key
        out = []
        for k in keys:
            t = cache.get(k)
            if t is None:
                t = cache[k] = derive(k)
                if len(cache) > CACHED_KEYS:
                    del cache[next(iter(cache))]  # the oldest
            out.append(t)
        return out

    def cached(self, tenant: str) -> int:
        """Keys of ``tenant`` remembered now (at most CACHED_KEYS)."""
        return len(self._cache[tenant])

    def count(self, tenant: str | None, what: str, n: int = 1) -> None:
        """Add ``n`` to ``tenant``'s counter ``what`` (one of COUNTERS; nothing for none)."""
        if tenant is not None and n:
            self._counts[tenant][what] += n

    def stats(self, tenant: str) -> dict[str, int]:
        """``tenant``'s counters."""
        out = dict(self._counts[tenant])
        out["auth_refused_total"] = self._claims[tenant] - out["sessions_total"]
        return out
