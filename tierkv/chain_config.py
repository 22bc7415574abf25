"""A store's chain of tiers as configuration: ``KVStore(spec, tiers=[...])``.

The chain lists tiers fastest to slowest, each a small typed entry (or the same as a dict, for
configuration files)::

    KVStore(spec, tiers=[
        tierkv.Device(bytes=8 << 30),                 # leased pages (GPU memory)
        tierkv.Host(bytes=64 << 30),                  # pinned host RAM
        tierkv.Cold(codec="int8", bytes=16 << 30),    # host RAM, compressed (lossy)
        tierkv.Disk(path="/nvme/kv", bytes=1 << 40),  # content pages, survive a restart
        tierkv.Remote(sources=[peer]),                # a peer's page server, Redis...
    ])
    KVStore(spec, tiers=[{"tier": "host", "bytes": 64 << 30}, {"tier": "disk", ...}])

Any subset in that order, with a tier that leases pages first: ``device`` (with ``host`` under
it whenever cold, disk or remote tiers follow: their moves go through host memory), or
``host`` (*host-first*: the caller's accelerator memory is not the store's; leases pin pages in
host memory, their victims go to cold, disk and remote directly). The old keyword arguments
(``device_bytes``, ``host_bytes``, ``codec``, ``cold_fraction``, ``disk_path``, ``disk_bytes``,
``remote``) are a shorthand that builds ``[Device, Host, Cold?, Disk?, Remote?]`` with
``cold_fraction`` of ``host_bytes`` given to ``Cold``, today's chain.

Everything is checked here, before anything is allocated: typed errors of
:class:`~tierkv.errors.TierConfigError` (unknown kinds, wrong types, duplicates, wrong order,
budgets under one page, ``tiers=`` together with an old keyword of a tier).

Plug-in tiers (:mod:`tierkv.chain_plugins`, ``register_tier``) are kinds here too, below
the host with the disk.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar

from tierkv import validate
from tierkv.arguments import checked_init
from tierkv.chain_plugins import (
    PLUGINS,
    PluginEntry,
    plugin_call,
    register_tier,
    unregister_tier,
)
from tierkv.codecs import CODECS, Codec, create_codec
from tierkv.errors import (
    InvalidInputError,
    InvalidTypeError,
    TierConfigError,
    TierConflictError,
    TierKVError,
    TierOrderError,
    TierSizeError,
    TierTypeError,
    UnknownTierError,
)
from tierkv.page_source import PageSource
from tierkv.page_table import MAX_PAGES
from tierkv.spec import KVSpec
from tierkv.tier_names import COLD, DEVICE, DISK, HOST, REMOTE

__all__ = [
    "UNSET",
    "Chain",
    "Cold",
    "Device",
    "Disk",
    "Host",
    "PluginEntry",
    "Remote",
    "TierEntry",
    "Unset",
    "budget_bytes",
    "build_chain",
    "conflicts",
    "register_tier",
    "shorthand",
    "unregister_tier",
]

ORDER = (DEVICE, HOST, COLD, DISK, REMOTE)  # fastest to slowest


class Unset(enum.Enum):
    """The default of the store's tier keywords: "not given" (a chain from ``tiers=``, or
    today's default without it)."""

    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


UNSET = Unset.UNSET


def budget_bytes(kind: str, x: object) -> int:
    """A tier entry's ``bytes``: an int >= 0 (numpy ints too, never a bool). Raises
    TierTypeError, TierSizeError (negative)."""
    try:
        return validate.byte_size(f"{kind} bytes", x)
    except InvalidTypeError as exc:
        raise TierTypeError(str(exc)) from None
    except InvalidInputError as exc:
        raise TierSizeError(str(exc)) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Budget:
    """A tier of whole pages and a budget in bytes."""

    kind: ClassVar[str] = ""
    bytes: int

    def __post_init__(self) -> None:
        budget_bytes(self.kind, self.bytes)


@checked_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Device(_Budget):
    """The device tier: leased pages, in accelerator memory (host memory on the cpu backend).

    ``bytes``: its budget, at least one page."""

    kind: ClassVar[str] = DEVICE


@checked_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Host(_Budget):
    """The host tier: pinned host RAM (pinned where CUDA is in use). Under a device tier it
    holds the device's victims; first in the chain it is the leased tier (host-first).

    ``bytes``: its budget, at least one page (the cold pool is a tier of its own here)."""

    kind: ClassVar[str] = HOST


@checked_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Cold:
    """The cold pool: host RAM holding pages compressed by ``codec`` (lossy for ``int8``;
    docs/codecs.md; a registered name, or a Codec built with options such as ``head-sparse``
    with its ranking). ``bytes``: its budget, at least one encoded page."""

    kind: ClassVar[str] = COLD
    codec: str | Codec = "int8"
    bytes: int

    def __post_init__(self) -> None:
        budget_bytes(self.kind, self.bytes)
        if isinstance(self.codec, Codec):
            return
        try:
            validate.registered("codec", self.codec, CODECS)
        except InvalidTypeError as exc:
            raise TierTypeError(str(exc)) from None


@checked_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Disk:
    """The disk tier (docs/disk.md): content pages on local disk, verified, found again by a
    later process on the same ``path`` (an existing, writable directory, checked at ``open()``).
    ``bytes``: its budget, at least one slot (a 4 KiB header and the page padded to 4 KiB).
    ``seen_twice``: the admission filter (an evicted page is written on its second offer,
    Dynamo's rule; a closing store writes every page): off by default, as it lowered the hit
    rate on the Mooncake trace at all but the smallest disk (docs/disk.md, "Admission")."""

    kind: ClassVar[str] = DISK
    path: str | os.PathLike[str]
    bytes: int
    seen_twice: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.path, str | os.PathLike):
            raise TierTypeError(f"disk path must be a str or path, got {type(self.path).__name__}")
        budget_bytes(self.kind, self.bytes)
        if not isinstance(self.seen_twice, bool):
            raise TierTypeError(
                f"disk seen_twice must be a bool, got {type(self.seen_twice).__name__}"
            )


@checked_init
@dataclass(frozen=True, slots=True, kw_only=True)
class Remote:
    """The remote tier: page sources consulted in order (any
    :class:`~tierkv.page_source.PageSource`: a peer's page server, a cluster, Redis; the
    caller opens and closes them). Its write options stay the store's ``remote_write``,
    ``remote_push_pages`` and ``remote_push_wait``."""

    kind: ClassVar[str] = REMOTE
    sources: Sequence[PageSource]

    def __post_init__(self) -> None:
        if isinstance(self.sources, str | bytes) or not isinstance(self.sources, Sequence):
            raise TierTypeError(f"remote sources: expected a list, got {self.sources!r}")
        if not self.sources:
            raise TierConfigError("a remote tier needs at least one source")
        for s in self.sources:
            if not isinstance(s, PageSource):
                raise TierTypeError(
                    f"remote source {s!r}: not a PageSource (lookup, load, publish)"
                )


TierEntry = Device | Host | Cold | Disk | Remote | PluginEntry
_BUILT_IN: dict[str, type[Any]] = {c.kind: c for c in (Device, Host, Cold, Disk, Remote)}
_LOWER = ORDER.index(DISK)  # plug-in tiers rank with the disk: below host and cold, above remote


def _kinds() -> dict[str, type[Any]]:
    return _BUILT_IN | PLUGINS


def _rank(kind: str) -> int:
    return ORDER.index(kind) if kind in ORDER else _LOWER


def _entry(x: object) -> TierEntry:
    """One chain entry as a typed spec (a dict ``{"tier": kind, field: value...}`` too)."""
    if isinstance(x, tuple(_kinds().values())):
        return x  # type: ignore[return-value]
    if not isinstance(x, Mapping):
        hint = (
            ' (a tier needs its size: {"tier": "host", "bytes": ...})' if isinstance(x, str) else ""
        )
        raise TierTypeError(
            f"a tier is tierkv.Device / Host / Cold / Disk / Remote, a registered tier's entry "
            f"or a dict, got {type(x).__name__} {x!r}{hint}"
        )
    kind = x.get("tier")
    if not isinstance(kind, str):
        raise TierTypeError(f'a tier dict names its kind as "tier": one of {ORDER}, got {x!r}')
    cls = _kinds().get(kind)
    if cls is None:
        raise UnknownTierError(f"unknown tier {kind!r}: known are {', '.join(_kinds())}")
    known = {f.name for f in fields(cls)}
    extra = sorted(str(k) for k in x if k != "tier" and k not in known)
    if extra:
        raise TierConfigError(f"{kind} tier: unknown field(s) {extra} (fields: {sorted(known)})")
    missing = sorted(f.name for f in fields(cls) if f.name not in x and _required(f))
    if missing:
        raise TierTypeError(f"{kind} tier: missing field(s) {missing} in {x!r}")
    try:
        entry: TierEntry = cls(**{k: v for k, v in x.items() if k != "tier"})
    except TierKVError:
        raise
    except Exception as exc:  # a plug-in entry's own check (a ValueError...): typed here
        raise TierConfigError(f"{kind} tier: {exc}") from exc
    return entry


def _required(f: Any) -> bool:
    return f.default is MISSING and f.default_factory is MISSING


@dataclass(frozen=True, slots=True)
class Chain:
    """A checked chain, in pages: what the store builds its tiers from."""

    names: tuple[str, ...]  # the kinds, fastest first
    lease_pages: int  # the top tier, where leases pin pages (device, or host when host-first)
    host_pages: int  # the host tier under the device (0: host-first, or a device alone)
    cold_pages: int
    codec_name: str | None
    codec: Codec | None = field(compare=False)  # (made from codec_name)
    disk: tuple[str, int, bool] | None  # path, bytes, seen_twice
    remote: list[PageSource] | None
    plugins: tuple[Any, ...] = ()  # plug-in tiers' entries (PluginEntry), in the listed order

    @property
    def host_first(self) -> bool:
        """The leased tier is in host memory: the chain has no device tier."""
        return self.names[0] == HOST

    @property
    def has_host(self) -> bool:
        """A tier of exact bytes in host memory holds the pages that leave (for remote glue,
        disk, page server): the host tier, or the leased tier of a host-first chain."""
        return HOST in self.names


def build_chain(spec: KVSpec, tiers: object) -> Chain:
    """Check ``tiers`` (fastest first) against ``spec`` and size it in pages. Raises
    TierConfigError and its subclasses; allocates nothing."""
    if isinstance(tiers, str | bytes | Mapping) or not isinstance(tiers, Sequence):
        raise TierTypeError(f"tiers: expected a list of tiers, fastest first, got {tiers!r}")
    entries = [_entry(x) for x in tiers]
    if not entries:
        raise TierConfigError("tiers: the chain is empty (give at least a device or host tier)")
    by: dict[str, Any] = {}
    for e in entries:
        if e.kind in by:
            raise TierOrderError(f"tiers: {e.kind} is listed twice")
        if by and _rank(e.kind) < max(_rank(k) for k in by):
            raise TierOrderError(
                f"tiers: {e.kind} listed after a slower tier; the order is fastest to "
                f"slowest: {' > '.join(ORDER)} (plug-in tiers with disk)"
            )
        by[e.kind] = e
    names = tuple(by)
    if names[0] not in (DEVICE, HOST):
        raise TierOrderError(
            f"tiers: the first tier holds the leased pages, device or host; got {names[0]}"
        )
    if names[0] == DEVICE and HOST not in by and len(names) > 1:
        raise TierOrderError(
            f"tiers: {', '.join(names[1:])} under a device tier need a host tier between "
            "(their moves read and write host memory)"
        )
    page = spec.page_bytes
    top = by[names[0]]
    lease = _pages(top.kind, top.bytes, page)
    host = _pages(HOST, by[HOST].bytes, page) if DEVICE in by and HOST in by else 0
    codec, cold = None, 0
    if COLD in by:
        codec = _codec(by[COLD].codec)
        codec.check_spec(spec)  # SpecError (or the codec's own) for pages it cannot encode
        cold = _pages(COLD, by[COLD].bytes, codec.encoded_bytes(spec), "encoded pages")
    disk = None
    if DISK in by:
        d = by[DISK]
        from tierkv.disk.layout import ALIGN, round_up  # pure arithmetic, no I/O

        _pages(DISK, d.bytes, ALIGN + round_up(page), "disk slots", most=1 << 62)
        disk = (os.fspath(d.path), int(d.bytes), d.seen_twice)
    remote = list(by[REMOTE].sources) if REMOTE in by else None
    name = codec.name if codec is not None else None
    plugins = tuple(e for e in entries if isinstance(e, PluginEntry) and e.kind in PLUGINS)
    for p in plugins:
        plugin_call(p.kind, "check", p.check, spec)
    return Chain(names, lease, host, cold, name, codec, disk, remote, plugins)


def _codec(codec: str | Codec) -> Codec:
    """A cold entry's codec: the instance given, or one made from its registered name."""
    return codec if isinstance(codec, Codec) else create_codec(codec)


def _pages(kind: str, size: int, unit: int, what: str = "pages", most: int = MAX_PAGES) -> int:
    n = int(size) // unit
    if n < 1:
        raise TierSizeError(
            f"{kind} budget holds no page: {size} bytes, {what} are {unit} bytes ({n} fit)"
        )
    if n > most:
        raise TierSizeError(
            f"{kind} budget of {size} bytes is {n} {what} of {unit} bytes, over the {most} a "
            "tier may hold (its bookkeeping alone would take ~90 bytes a page): give larger "
            "pages (page_tokens) or a smaller budget"
        )
    return n


def shorthand(
    spec: KVSpec,
    *,
    device_bytes: int,
    host_bytes: int,
    codec: str | Codec | None,
    cold_fraction: float,
    disk: tuple[str, int] | None,
    remote: list[PageSource] | None,
) -> list[TierEntry]:
    """Today's keyword arguments (checked already) as the chain they always built:
    ``cold_fraction`` of ``host_bytes`` becomes the cold pool (none without a codec or when
    it holds no encoded page: compression then does nothing, as before)."""
    cold_bytes = int(host_bytes * cold_fraction) if codec else 0
    out: list[TierEntry] = [Device(bytes=device_bytes), Host(bytes=host_bytes - cold_bytes)]
    if codec and cold_bytes >= _codec(codec).encoded_bytes(spec):
        out.append(Cold(codec=codec, bytes=cold_bytes))
    if disk is not None:
        out.append(Disk(path=disk[0], bytes=disk[1]))
    if remote:
        out.append(Remote(sources=remote))
    return out


def conflicts(given: Mapping[str, bool]) -> None:
    """Raise TierConflictError when ``tiers=`` comes with old tier keywords (``given``: for
    each of those keywords, whether the caller gave it)."""
    both = sorted(k for k, v in given.items() if v)
    if both:
        raise TierConflictError(
            f"tiers= and {', '.join(both)} both configure tiers: give the chain in tiers= "
            "alone (or the keyword arguments alone)"
        )
