"""What a server counts and logs about hostile peers, and the budgets it keeps per peer.

::

    Audit        counters of refused authentication, protocol errors and budget hits, each also
                 logged as one JSON line (logger "tierkv.security"), at most `burst` lines per
                 event kind and `rate` a second after that (the rest are counted, and the next
                 line says how many were suppressed)
    PeerCaps     connections per peer address (refused past the cap: a budget hit)
    RateLimit    a token bucket (e.g. new peer links per minute)
    Gate         who may start a handshake now, decided from the address alone (before anything
                 is read or allocated for the connection): connections per address (all / not
                 yet authenticated), unauthenticated ones in total, and a penalty per address
                 that failed its handshake too often (each failure takes a token of its bucket)
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter

__all__ = [
    "AUTH_REFUSED",
    "BUDGET_HIT",
    "PROTOCOL_ERROR",
    "Audit",
    "Gate",
    "PeerCaps",
    "RateLimit",
]

log = logging.getLogger("tierkv.security")

AUTH_REFUSED = "auth_refused"
PROTOCOL_ERROR = "protocol_error"
BUDGET_HIT = "budget_hit"


class RateLimit:
    """A token bucket: `take()` is True at most `burst` times at once, then `rate` per second."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = rate, burst
        self._tokens = burst
        self._at = time.monotonic()

    def available(self) -> float:
        """The tokens there are now."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens

    def take(self) -> bool:
        """Spend one token if there is one."""
        if self.available() >= 1.0:
            self._tokens -= 1.0
            return True
        return False


class Audit:
    """Security counters of one component and their rate-limited structured log.

    `counts[event]` counts every `note` (whether logged or not); `by_reason` splits them by
    the ``reason`` field (e.g. ``budget_hit`` by which budget).
    """

    def __init__(self, component: str, *, rate: float = 1.0, burst: float = 10.0) -> None:
        self.component = component
        self.counts: Counter[str] = Counter()
        self.by_reason: Counter[str] = Counter()
        self._limits: dict[str, RateLimit] = {}
        self._suppressed: Counter[str] = Counter()
        self._rate, self._burst = rate, burst

    def note(self, event: str, peer: str, reason: str, **fields: object) -> None:
        """Count one event (``auth_refused``, ``protocol_error``, ``budget_hit``) and log it
        unless this kind is over its log rate. ``reason`` is one of a few fixed words (it
        keys ``by_reason``); peer-controlled text goes in ``fields`` (e.g. ``detail``),
        cut to 160 characters."""
        self.counts[event] += 1
        key = f"{event}:{reason}"
        if key in self.by_reason or len(self.by_reason) < 64:
            self.by_reason[key] += 1
        limit = self._limits.get(event)
        if limit is None:
            limit = self._limits[event] = RateLimit(self._rate, self._burst)
        if not limit.take():
            self._suppressed[event] += 1
            return
        line: dict[str, object] = {
            "event": event,
            "component": self.component,
            "peer": peer,
            "reason": reason,
        }
        line.update(
            {k: v if isinstance(v, int | float | bool) else str(v)[:160] for k, v in fields.items()}
        )
        if self._suppressed[event]:
            line["suppressed"] = self._suppressed.pop(event)
        log.warning(json.dumps(line, sort_keys=True))

    def stats(self) -> dict[str, int]:
        """``<event>_total`` for each event kind (zero when none happened)."""
        return {f"{e}_total": self.counts[e] for e in (AUTH_REFUSED, PROTOCOL_ERROR, BUDGET_HIT)}


class PeerCaps:
    """At most `cap` open connections per peer address."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.open: Counter[str] = Counter()

    def admit(self, address: str) -> bool:
        """Count a new connection from ``address``; False (not counted) when over the cap."""
        if self.open[address] >= self.cap:
            return False
        self.open[address] += 1
        return True

    def release(self, address: str) -> None:
        """A connection admitted from ``address`` closed."""
        self.open[address] -= 1
        if self.open[address] <= 0:
            del self.open[address]


class Gate:
    """Admission of new connections by peer address, before their handshake.

    Args:
        per_peer: open connections per address (authenticated or not).
        preauth_per_peer: connections per address that have not authenticated yet.
        preauth_total: connections that have not authenticated yet, from every address.
        failures: handshake failures (bad proof, malformed hello, deadline) an address may
            have at once before its new connections are refused; None: no penalty.
        forgiven_per_s: failures forgotten per second (the penalty's refill rate).
        max_tracked: addresses whose failures are remembered (the oldest go first; an
            attacker with more addresses than this can flush the table: the other caps and
            `preauth_total` still bound it).

    `admit` counts a connection (both caps) or names the budget that refuses it; the caller
    reports `authenticated` once, and `closed` exactly once for every admitted connection.
    """

    def __init__(
        self,
        *,
        per_peer: int,
        preauth_per_peer: int,
        preauth_total: int,
        failures: int | None = 64,
        forgiven_per_s: float = 1.0,
        max_tracked: int = 4096,
    ) -> None:
        self._open = PeerCaps(per_peer)
        self._preauth = PeerCaps(preauth_per_peer)
        self.preauth_total = preauth_total
        self.preauth_now = 0
        self.failures, self.forgiven_per_s = failures, forgiven_per_s
        self.max_tracked = max_tracked
        self._strikes: dict[str, RateLimit] = {}

    def penalized(self, address: str) -> bool:
        """True while ``address`` has used up its handshake failures."""
        bucket = self._strikes.get(address)
        if bucket is None:
            return False
        tokens = bucket.available()
        if tokens >= bucket.burst:
            del self._strikes[address]  # forgiven: forget it
            return False
        return tokens < 1.0

    def admit(self, address: str) -> str | None:
        """Count a new connection from ``address``, or return the budget that refuses it
        (``penalty``, ``preauth_total``, ``connections_per_peer``, ``preauth_per_peer``)."""
        if self.penalized(address):
            return "penalty"
        if self.preauth_now >= self.preauth_total:
            return "preauth_total"
        if not self._open.admit(address):
            return "connections_per_peer"
        if not self._preauth.admit(address):
            self._open.release(address)
            return "preauth_per_peer"
        self.preauth_now += 1
        return None

    def authenticated(self, address: str) -> None:
        """An admitted connection from ``address`` completed its handshake."""
        self._preauth.release(address)
        self.preauth_now -= 1

    def closed(self, address: str, *, authenticated: bool) -> None:
        """An admitted connection from ``address`` closed (``authenticated`` or not)."""
        if not authenticated:
            self.authenticated(address)  # its pre-auth slot goes too
        self._open.release(address)

    def failed(self, address: str) -> None:
        """``address`` failed a handshake: one strike (no-op without a penalty)."""
        if self.failures is None:
            return
        bucket = self._strikes.get(address)
        if bucket is None:
            if len(self._strikes) >= self.max_tracked:
                del self._strikes[next(iter(self._strikes))]
            bucket = self._strikes[address] = RateLimit(self.forgiven_per_s, self.failures)
        bucket.take()
