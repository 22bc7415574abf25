"""The tiers below the host: plug-in `Tier`s (:mod:`tierkv.tier`) a store chains after its
host tier, moved to and from only through the handlers registered for their media::

    KVStore(disk_path=...)   host victims (exact bytes) --moves[host, disk]--> DiskTier
                             add_sequence / fetch_prefix / lookup: blocks missing locally
                                tier.lookup -> reserve host slots -> moves[disk, host] -> commit

Pages leaving the host tier (evicted by its policy, or compressed idle) are written to every
lower tier that accepts them (`Tier.accepts`: the disk takes content pages only), one engine
job per tier, awaited by the eviction while the host slots are pinned; a failed write is
counted (``write_failed`` here, the medium's own counters there) and the page is not reported
stored. A store closing writes its remaining pages down too (`persist`: the host tier's, and
those the device tier alone holds, copied down first). A prefix
lookup that misses the host sees the lower tiers' indexes; importing runs the tier's read move
as the engine job of `RemoteGlue.import_host` (``tiers.glue``; the pages land as unowned
cached host pages, two-phase: a page that fails the medium's verification is a miss, rolled
back).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from tierkv.chain_config import Chain
from tierkv.chain_plugins import plugin_call
from tierkv.errors import EngineError, StoreTimeoutError, TierTypeError
from tierkv.failures import FailureLog
from tierkv.jobs import job_done, within
from tierkv.keys import PageKey
from tierkv.page_table import PageState
from tierkv.runtime import TransferHandle
from tierkv.spec import KVSpec
from tierkv.table_view import TableView
from tierkv.tier import Batch, MoveHandler, Moves, Tier
from tierkv.tier_names import COLD, DEVICE, DISK, HOST, REMOTE
from tierkv.tiers import TierSet

__all__ = ["ChainCounters", "LowerChain", "open_lower"]


@dataclass(slots=True)
class ChainCounters:
    """What the chain asked of one lower tier."""

    offered: int = 0  # pages leaving the host that the tier accepts
    stored: int = 0  # written and committed (or already there)
    write_failed: int = 0  # refused (no room, busy) or failed: never reported stored
    not_admitted: int = 0  # evicted pages the tier's admission filter declined (not written)
    imported: int = 0  # pages read back into the host tier, verified
    import_missed: int = 0  # pages the index had that the read did not deliver (corrupt...)
    errors: int = 0  # jobs that failed whole (counted, not raised)
    last_error: str = ""


class LowerChain:
    """The lower tiers of one store, fastest first, and the moves between them and the host."""

    def __init__(
        self, tiers: Sequence[Tier], register: Callable[[Moves], None], timeout: float
    ) -> None:
        """``register(moves)`` registers the tiers' moves (host <-> medium) in a registry: the
        tier core's, at :meth:`attach` (one registry for every move of the store)."""
        probe = Moves()
        register(probe)
        for t in tiers:
            probe.get(HOST, t.medium)  # raises UnknownMoveError before anything is used
            probe.get(t.medium, HOST)
        self.tiers = list(tiers)
        self._register = register
        self.timeout = timeout
        self.counters = {t.medium: ChainCounters() for t in self.tiers}
        self._core: TierSet | None = None
        self._failures = FailureLog("tierkv.chain")

    def attach(self, core: TierSet) -> None:
        """Hook into an opened store's tier core: the tiers' moves join its registry
        (``core.moves``); pages leaving its host come here."""
        self._register(core.moves)
        self._core = core
        core.chain.extend(self.tiers)
        core.glue.set_spill(self.spill)

    def detach(self) -> None:
        """Stop taking pages (before the engine closes)."""
        if self._core is not None:
            self._core.glue.set_spill(None)

    def close(self) -> None:
        """Close every lower tier's medium (idempotent): one that fails to is counted and
        logged, and the others close all the same."""
        self.detach()
        for t in self.tiers:
            try:
                t.close()
            except Exception as exc:  # a plug-in's failure: a close never fails for it
                self._fail(self.counters[t.medium], t.medium, "lower tier close", exc, ())

    def _held(self, tier: Tier, keys: Sequence[PageKey], what: str) -> list[bool] | None:
        """``tier.lookup(keys)``, checked: None, counted and logged, when the tier raised or
        answered anything but one bool per key (a plug-in's bug or its medium gone)."""
        try:
            got = tier.lookup(keys)
            if not isinstance(got, list) or len(got) != len(keys):
                raise EngineError(
                    f"{tier.medium} tier: lookup of {len(keys)} keys answered {got!r:.60}"
                )
            return [bool(h) for h in got]
        except Exception as exc:
            self._fail(self.counters[tier.medium], tier.medium, what, exc, keys)
            return None

    def _fail(
        self, c: ChainCounters, medium: str, what: str, exc: BaseException, keys: Any
    ) -> None:
        c.errors += 1
        c.last_error = self._failures.report(what, exc, tier=medium, keys=list(keys))

    async def spill(self, victims: list[tuple[PageKey, int]], *, filtered: bool = True) -> None:
        """Write host pages about to leave to each lower tier that accepts them, does not
        hold them yet and (when `filtered`: an eviction) admits them (`Tier.admit`). Raises
        StoreTimeoutError past the store's timeout and CancelledError (the caller keeps the
        pages in the host then); any other failure is counted."""
        core = self._core
        assert core is not None
        for tier in self.tiers:
            c = self.counters[tier.medium]
            todo = [(k, s) for k, s in victims if tier.accepts(k)]
            if not todo:
                continue
            keys, slots = [k for k, _ in todo], [s for _, s in todo]
            c.offered += len(keys)
            try:
                held = self._held(tier, keys, "lower tier lookup")
                if held is None:
                    c.write_failed += len(keys)
                    continue
                if all(held):
                    c.stored += len(keys)
                    continue
                keys = [k for k, h in zip(keys, held, strict=True) if not h]
                slots = [s for s, h in zip(slots, held, strict=True) if not h]
                c.stored += len(held) - len(keys)  # there already
                if filtered:
                    ok = tier.admit(keys)
                    c.not_admitted += ok.count(False)
                    keys = [k for k, a in zip(keys, ok, strict=True) if a]
                    slots = [s for s, a in zip(slots, ok, strict=True) if a]
                    if not keys:
                        continue
                tier.make_room(len(keys))
                batch = Batch(keys, core.glue.host_arena, slots)
                handle = core.moves.get(core.glue.host_medium, tier.medium)(
                    core.engine, tier, batch
                )
            except Exception as exc:  # (a plug-in's own failure too: counted, not raised)
                c.write_failed += len(keys)
                self._fail(c, tier.medium, "lower tier write", exc, keys)
                continue
            try:
                await within(core.changes.deadline(self.timeout), job_done(handle), _late)
                done = sum(getattr(st, "held", False) is True for st in handle.result())
            except StoreTimeoutError:
                raise
            except Exception as exc:  # the job failed whole (its medium closed, a plug-in's
                c.write_failed += len(keys)  # move raised...): counted, never raised
                self._fail(c, tier.medium, "lower tier write", exc, keys)
                continue
            c.stored += done
            c.write_failed += len(keys) - done

    async def persist(self, batch: int = 256) -> None:
        """Write the readable pages a lower tier accepts and lacks down (a store closing: so
        that the next process on the same path finds them), ``batch`` pages per job: the host
        tier's, then those the device tier alone holds (write-behind not run yet, or off),
        copied down to the host a batch at a time first. Each batch is pinned in the host
        while written. Raises like `spill`."""
        core = self._core
        if core is None:
            return
        table = core.table
        deadline = core.changes.deadline(self.timeout)
        while core.pages.write_behind_pinned:  # copies down in flight (their task was cancelled)
            await core.changes.wait(deadline, _late)
        top = core.top  # the host tier (the leased tier of a host-first store)
        keys = [k for k in table.keys(top) if self._wanted(k)]
        for i in range(0, len(keys), batch):
            await self._persist_host(core, keys[i : i + batch])
        # (without a host tier the leased tier is the top one: its pages went above)
        device = [k for k in table.keys(DEVICE) if self._wanted(k)] if top != DEVICE else []
        for i in range(0, len(device), batch):
            part = [k for k in device[i : i + batch] if not _readable(table, k, top)]
            if part:
                await core.pages.write_behind(part)  # dirty device pages copied to the host
                await self._persist_host(core, part)

    def _wanted(self, key: PageKey) -> bool:
        return any(t.accepts(key) for t in self.tiers)

    async def _persist_host(self, core: TierSet, keys: list[PageKey]) -> None:
        table = core.table
        part = [k for k in keys if _readable(table, k, core.top)]
        slots = core.glue.pin_host(part)
        try:
            await self.spill(list(zip(part, slots, strict=True)), filtered=False)
        finally:
            core.glue.unpin_host(part)

    def lookup(self, pages: Sequence[PageKey]) -> list[bool]:
        """Per page, whether some lower tier holds it (their indexes: no I/O)."""
        found = [False] * len(pages)
        for tier in self.tiers:
            rest = [i for i, f in enumerate(found) if not f]
            if not rest:
                break
            held = self._held(tier, [pages[i] for i in rest], "lower tier lookup")
            for i, h in zip(rest, held or (), strict=False):  # (None: a counted miss)
                found[i] = h
        return found

    async def fetch(self, pages: list[PageKey]) -> int:
        """Import into the host the pages that no local tier holds and a lower tier does,
        each from the first tier holding it (room is made sparing ``pages`` held locally: the
        rest of the prefix); returns the pages imported. A page the read
        could not verify is a counted miss. Raises StoreClosedError / StoreTimeoutError as
        `RemoteGlue.import_host` (`tiers.glue`); a failed read job is counted, not raised."""
        core = self._core
        assert core is not None
        got = 0
        for tier in self.tiers:
            local = {k for t in core.table.tier_names for k in core.table.present(pages, t)}
            want = [k for k in pages if k not in local and tier.accepts(k)]
            held = self._held(tier, want, "lower tier lookup") if want else []
            want = [k for k, h in zip(want, held or (), strict=False) if h]
            if not want:
                continue
            c = self.counters[tier.medium]
            move = core.moves.get(tier.medium, core.glue.host_medium)
            job = partial(self._read_job, core, tier, move)
            try:
                n = await core.glue.import_host(
                    want, job=job, timeout=self.timeout, tier=tier.medium, keep=frozenset(pages)
                )
            except StoreTimeoutError:
                raise
            except Exception as exc:  # (a plug-in tier's read move raising too: counted)
                self._fail(c, tier.medium, "lower tier read", exc, want)
                continue
            c.imported += n
            c.import_missed += len(want) - n
            got += n
        return got

    @staticmethod
    def _read_job(
        core: TierSet, tier: Tier, move: MoveHandler, new: list[PageKey], slots: list[int]
    ) -> TransferHandle:
        return move(core.engine, tier, Batch(new, core.glue.host_arena, slots))

    def stats(self) -> dict[str, Any]:
        """Per lower tier: its medium's counters and the chain's."""
        out: dict[str, Any] = {}
        for tier in self.tiers:
            c = self.counters[tier.medium]
            try:
                own = dict(tier.stats())
            except Exception as exc:  # (a plug-in's stats: the chain's counters still answer)
                own = {"stats_error": repr(exc)}
            out[tier.medium] = own | {
                "offered": c.offered,
                "stored": c.stored,
                "write_failed": c.write_failed,
                "not_admitted": c.not_admitted,
                "imported": c.imported,
                "import_missed": c.import_missed,
                "errors": c.errors,
                "chain_last_error": c.last_error,
            }
        return out


def _open_plugin(kind: str, entry: Any, spec: KVSpec, taken: Collection[str]) -> Tier:
    """A plug-in entry's opened tier (its hook's failure a TierConfigError: `plugin_call`).
    Raises TierTypeError, what it opened closed, for a result that is not a `Tier` (None was
    an AttributeError when the chain closed it) or whose medium is a built-in tier's name or
    one of ``taken`` (the chain's media opened before it): the moves and counters are keyed
    by the medium, so a plug-in naming 'disk' or 'host' would take that tier's."""
    tier = plugin_call(kind, "open", entry.open, spec)
    if not isinstance(tier, Tier):
        closing = getattr(tier, "close", None)
        if callable(closing):
            closing()
        raise TierTypeError(f"plug-in tier {kind!r}: open gave {type(tier).__name__}, not a Tier")
    medium = tier.medium
    if (
        not isinstance(medium, str)
        or medium in (DEVICE, HOST, COLD, DISK, REMOTE)
        or medium in taken
    ):
        tier.close()
        raise TierTypeError(
            f"plug-in tier {kind!r}: its tier's medium is {medium!r}, another tier's (its moves "
            "and counters would be that tier's)"
        )
    return tier


def open_lower(spec: KVSpec, chain: Chain, timeout: float) -> LowerChain | None:
    """Open the media of a checked chain's tiers below the host, in the listed order (the disk
    and the plug-in tiers), as one `LowerChain` (their moves join the core's registry when it
    attaches); None when the chain has none. Raises what a medium's open raises, the media
    opened before it closed again."""
    opened: list[Tier] = []
    movers: list[Callable[[Moves], None]] = []
    plugins = {p.kind: p for p in chain.plugins}
    try:
        for kind in chain.names:
            if kind == DISK and chain.disk is not None:
                from tierkv.disk.tier import DiskTier, register_moves  # only a store with a disk

                path, size, seen_twice = chain.disk
                opened.append(
                    DiskTier.open(
                        path,
                        page_bytes=spec.page_bytes,
                        disk_bytes=size,
                        seen_twice=seen_twice,
                        close_timeout=timeout,  # a close never hangs on a hung disk
                    )
                )
                movers.append(register_moves)
            elif kind in plugins:
                entry = plugins[kind]
                opened.append(_open_plugin(kind, entry, spec, {t.medium for t in opened}))
                movers.append(partial(plugin_call, kind, "register_moves", entry.register_moves))
        if not opened:
            return None

        def register(moves: Moves) -> None:
            for r in movers:
                r(moves)

        return LowerChain(opened, register, timeout)
    except BaseException:
        for t in opened:
            t.close()
        raise


def _readable(table: TableView, key: PageKey, top: str) -> bool:
    """Whether the host tier (``top``: the leased one of a host-first store) holds a
    readable copy of ``key``."""
    return bool(table.present([key], top)) and table.state(key, top) is PageState.READABLE


def _late() -> StoreTimeoutError:
    return StoreTimeoutError("a write to a lower tier did not end in time")
