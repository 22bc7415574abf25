"""A step: some sequences run some layers, each appending its count of new tokens to every
layer; planned once, then each layer costs at most a wait, two ``index_copy_`` and one
``index_select``.

::

    async with store.step_plan(ids, tokens=1) as step:      # one call plans the step
        for layer in range(num_layers):
            h = await step.layer(layer)                     # its pages pinned, its rows ready
            h.append(k, v)                                  # [B, H, n, D] or [H, N, D]
            k_all, v_all = h.kv()                           # [B, H, S, D] each (or h.kv_list())

What the plan does, so that a layer's path has no Python per page and allocates nothing per
page: at entry it checks everything, gives the sequences the blocks the step fills, announces
the step's pages in the order it reads them (the pages it writes first: evicted last) and
takes the device room of its window (two groups of ``max(1, ahead)`` layers; ``ahead`` shrinks
where that does not fit) from the store's admission. Layers then load in groups: one task per
group pins its pages (loading those not resident: one acquire, one engine batch), opens the
new pages its appends need and builds each layer's row indices (:mod:`tierkv.step_plan`).
:meth:`StepPlan.layer`, at a group's first layer, lets go of the group before (its pins),
starts the next group's loads and waits for its own (none when they landed);
:meth:`StepPlan.layer_now` serves the layers of a landed group with no event loop run (a
group's first too, for a caller that runs the loop). At exit full blocks get content keys,
written pages go down in one write-behind, and the next step's first group is prefetched.
The file stays whole: entry checks, group loads and exit are one plan's life cycle, sharing
its state (the rows and indices live in :mod:`tierkv.step_plan`, the layer handle in
:mod:`tierkv.step_layer`).

Late fetches (``stats()["late_fetches"]``): a group's loads are late when the layer that needs
them asked before their copies ended (``TierStats.loads_landed_at``): compute waited on a
fetch. A group whose task had not run since its copies ended waits a loop turn: not late.

The announced order makes evictions take, among the step's pages, the one read last: in the
cyclic walk over layers a steady set of layers stays resident and the rest stream through the
window (the lease path's recency order evicted each layer's pages just before the next step
read them: 0.98 loads per page per step against 0.64, benchmarks/step.py at batch 1).

Errors: a bad argument (an unknown or released sequence, a layer out of range or out of the
plan's order, a tensor of the wrong shape, dtype or device) raises the typed error before
anything changes; a layer whose load failed raises at its wait. At exit (or error, or
cancellation) nothing stays pinned or admitted, and the new pages of layers never appended
to are dropped. A group names its pages when it starts loading, and again when a lease of the
same sequences ended during its wait and published their full blocks (pages renamed to content
keys: :func:`tierkv.lease.acquire_current`); a sequence released before or during a group's
load makes that layer raise SequenceError. The pages a group pinned cannot be renamed while
pinned, and their use is recorded when the group lets go of them (by the names they have then).

The tier core's surface it uses: ``TierSet.announce``, ``acquire_device``, ``unpin_device``,
``reserve_device``, ``zero_device``, ``commit_device``, ``pin_device``, ``own``,
``abort_device``, ``device_slots``, ``mark_dirty``, ``seal``, ``ensure_fits``, ``deadline``,
``full_error``, ``table`` (capacity), ``device_pages`` (new), ``all_pages`` and ``device``.
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import torch

from tierkv import validate
from tierkv.boundary import async_boundary, boundary
from tierkv.errors import SequenceError, SpecError, TierKVError
from tierkv.lease import acquire_current
from tierkv.lease_host import LeaseHost
from tierkv.runtime import Priority
from tierkv.sequence import SequenceState, page_key
from tierkv.step_layer import LayerStep, check_tokens
from tierkv.step_plan import (
    GroupPages,
    LayerPages,
    LayerRows,
    arena_rows,
    group_pages,
    step_order,
)
from tierkv.tenant_room import reserve_by_tenant, reserve_now_by_tenant
from tierkv.tier_names import DEVICE

__all__ = ["LayerStep", "NextStep", "StepPlan", "check_tokens"]

# loads the next step's first layers of some sequences, in the background
NextStep = Callable[[list[str], list[int]], Awaitable[int]]


class StepPlan:
    """A planned step (see the module docstring); made by
    :meth:`tierkv.store.KVStore.step_plan`, used as an async context manager.

    Layers load in groups of ``max(1, ahead)``: one pin, one load and one reservation per
    group. ``window`` groups are pinned at a time: with 2, group ``g + 1`` loads while group
    ``g`` computes (from ``g``'s first layer); with 1, once the caller is done with ``g``'s
    last layer (:meth:`done_with`), after ``g`` is let go of: half the device room for groups
    of the same size, for copies that do not overlap compute anyway (the cpu backend's inline
    copies run on the caller's thread).
    """

    def __init__(
        self,
        store: LeaseHost,
        seqs: list[SequenceState],
        layers: list[int],
        tokens: list[int],
        ahead: int,
        next_step: NextStep,
        window: int = 2,
    ) -> None:
        self.store = store
        self.window = window  # groups pinned at a time (1 or 2)
        self._next_step = next_step
        self.seqs = tuple(seqs)
        self.layers = tuple(layers)
        self.tokens = tokens
        self.ahead = ahead
        self._index = {layer: i for i, layer in enumerate(layers)}
        self._tasks: list[asyncio.Future[list[LayerStep]] | None] = []
        self._released: list[bool] = []
        self._landed: list[list[LayerStep] | None] = []  # each landed group's steps
        self._next = 0  # the index of the layer the next layer() call must name
        self._current: LayerStep | None = None
        self._held: int | None = None
        self._wrote: list[int] = []  # the layers it appended to (one write-behind at exit)
        self._behind_partial = True  # its write-behind takes the partly filled pages too
        self._active = False
        self._claimed = False  # its sequences taken in the store's StepClaims
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it was entered on
        self.starting: asyncio.Future[Any] | None = None  # (see layer_now and exit_now)
        tiers = store.tiers
        self.flat, self._per_slot = arena_rows(tiers.pages.all_pages, store.spec)
        # the sequences are several tenants': their new pages ask for room tenant by tenant
        self._tenants = store.tenants if len({s.tenant for s in seqs}) > 1 else None
        self.pages = tiers.pages.all_pages  # [slots, 2, H, T, D]
        self.by_page = self.pages.permute(1, 2, 0, 3, 4)  # [2, H, slots, T, D]
        self.page_strides = self.pages.stride()  # (a slot's tokens as one as_strided view)
        self.page_offset = int(self.pages.storage_offset())
        self.waited_pages = 0

    @property
    def group(self) -> int:
        """Layers per load group."""
        return max(1, self.ahead)

    # -- entry and exit ------------------------------------------------------------------
    def _footprint(self, capacity: int) -> int:
        """The most device pages the step pins at once: two groups' (one with ``ahead=0``).
        ``ahead`` shrinks (to 0 at least) until that fits ``capacity`` pages."""
        t = self.store.spec.page_tokens
        per = [0] * len(self.layers)
        for seq, k in zip(self.seqs, self.tokens):  # (each sequence's lengths read at once)
            kv = seq.kv_len
            for i, layer in enumerate(self.layers):
                per[i] += -(-(kv[layer] + k) // t)
        while True:
            g = self.group
            sums = [sum(per[i : i + g]) for i in range(0, len(per), g)]
            w = self.window if self.ahead else 1
            most = max((sum(sums[i : i + w]) for i in range(len(sums))), default=0)
            if most <= capacity or not self.ahead:
                return most
            self.ahead -= 1

    @async_boundary
    async def __aenter__(self) -> StepPlan:
        """Take the step's room from the admission and start the first layers' loads.

        Raises TierFullError (the window of layers can never be resident, or no room came
        before the timeout), SequenceError (a sequence was released, or is in another entered
        plan, or, when the plan appends to it, in an entered lease over one of the plan's
        layers: one writer of a sequence at a time, :mod:`tierkv.step_claims`). Nothing is
        held then.
        """
        store = self.store
        tiers = store.tiers
        footprint = self._entry()
        self._claim()
        try:
            self._prepare()
            deadline = tiers.changes.deadline(store.timeout)
            held = await store.admission.enter(
                footprint, deadline, partial(tiers.room.full_error, footprint, store.timeout)
            )
        except BaseException:
            self._unclaim()
            raise
        self._go(held, asyncio.get_running_loop())
        return self

    @boundary
    def enter_now(self, loop: asyncio.AbstractEventLoop) -> bool:
        """:meth:`__aenter__` with no wait, for a caller that drives the store's ``loop``
        itself, outside it now: True when the admission took the step's room at once (the
        first groups' loads then started as ``__aenter__`` starts them; leave with
        ``__aexit__``); False, with nothing held, where it would wait (use ``async with``).
        Raises what ``__aenter__`` raises before anything is held."""
        footprint = self._entry()
        self._claim()
        held = self.store.admission.enter_now(footprint)
        if held is None:
            self._unclaim()
            return False
        try:
            self._prepare()
        except BaseException:
            self.store.admission.leave(held)
            self._unclaim()
            raise
        self._go(held, loop)
        return True

    def _entry(self) -> int:
        """An entry's checks; returns the step's footprint (its window fitted to the device).
        Raises SequenceError (a sequence was released), TierFullError (never fits)."""
        tiers = self.store.tiers
        for seq in self.seqs:
            self._check_live(seq)
        footprint = self._footprint(tiers.table.capacity(DEVICE))
        tiers.room.ensure_fits(footprint)
        return footprint

    def _claim(self) -> None:
        """Take the plan's sequences (:class:`tierkv.step_claims.StepClaims`). Raises
        SequenceError, nothing taken, when one is in another entered plan, or this plan is
        entered already."""
        if self._claimed:
            raise SequenceError("this step plan is entered already")
        if self._loop is not None:  # (set once entered: its layers and loads are spent)
            raise SequenceError("this step plan ran already: plan each step anew (step_plan)")
        bits = sum(1 << layer for layer in self.layers)
        self.store.steps.claim(self.seqs, [bits if n else 0 for n in self.tokens])
        self._claimed = True

    def _unclaim(self) -> None:
        """Free the plan's sequences for the next plan (idempotent)."""
        if self._claimed:
            self._claimed = False
            self.store.steps.free(self.seqs)

    def _prepare(self) -> None:
        """The sequences' blocks the step fills, and its pages announced in reading order."""
        store = self.store
        groups = -(-len(self.layers) // self.group)
        self._tasks = [None] * groups
        self._released = [False] * groups
        self._landed = [None] * groups
        t = store.spec.page_tokens
        for seq, k in zip(self.seqs, self.tokens):  # the blocks the step fills (extras harmless)
            need = -(-(max(seq.kv_len) + k) // t)
            while seq.num_blocks < need:
                seq.append_block(seq.private_block(seq.num_blocks), shared=False)
        # The step's pages in the order it reads them: evictions take pages outside the step
        # first, then the one read last (a cyclic walk over the layers then keeps a steady set
        # of layers resident and streams the rest, instead of evicting each layer's pages just
        # before the next step reads them). The pages it writes come first (evicted last):
        # they go down by the step's write-behind once filled, not by an eviction's wait.
        store.tiers.announce(step_order(self.seqs, self.tokens, self.layers, t))

    def _go(self, held: int, loop: asyncio.AbstractEventLoop) -> None:
        """Admitted (``held`` pages): active, the first groups' loads started."""
        self._held = held
        self._loop = loop
        self._active = True
        # the partly filled pages it writes (one a sequence and layer) stay on the device
        # with its window: the next step writes them again, so its write-behind copies down
        # only the pages it fills, unless the device could not keep them all
        partial = sum(1 for k in self.tokens if k) * len(self.layers)
        self._behind_partial = partial + held > self.store.tiers.table.capacity(DEVICE)
        for g in range(min(len(self._tasks), self.window if self.ahead else 0)):
            self._start(g)

    @async_boundary
    async def __aexit__(self, *exc: object) -> None:
        t0 = time.perf_counter()
        self._active = False
        self._current = None
        try:
            pending = [t for t in self._tasks if t is not None and not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        except BaseException:
            self._let_go()
            raise
        ids = self._leave(t0, exc[0] is None)
        if ids:  # the next step's first layers, loading while the caller samples
            await self._next_step(ids, list(self.layers[: self.group]))

    @boundary
    def exit_now(self) -> bool:
        """:meth:`__aexit__` after a step that raised nothing, with no loop run, for a caller
        that drives the store's loop itself (outside it now): False, nothing done, where a
        group's load is still under way (use ``__aexit__``). The next step's first group is
        prefetched as ``__aexit__`` does (its task is :attr:`starting`: the caller runs its
        loop a few turns), except where its copy would run inline on this thread (the cpu
        backend): the next step's entry then loads it with no wait, and prefetching it now
        overlaps nothing. Raises what ``__aexit__`` raises."""
        if any(t is not None and not t.done() for t in self._tasks):
            return False
        t0 = time.perf_counter()
        self._active = False
        self._current = None
        ids = self._leave(t0, True)
        if ids and not self._loads_inline():
            loop = self._loop
            assert loop is not None  # (entered: ids are only given then)
            self.starting = asyncio.ensure_future(
                self._next_step(ids, list(self.layers[: self.group])), loop=loop
            )
        return True

    def _leave(self, t0: float, ok: bool) -> list[str]:
        """The exit once no group's load is under way: every group let go of, the room given
        back, full blocks published, the written pages' one write-behind. Returns the live
        sequences whose next step's first group to prefetch (none unless the step ran every
        layer, ``ok`` and with a window)."""
        store = self.store
        try:
            if store.closed:
                return []  # close() let go of every page
            for g in range(len(self._tasks)):
                self._release(g)
        finally:
            self._let_go()
        wrote, self._wrote = self._wrote, []
        live = [s for s in self.seqs if store.is_live(s)]
        store.lease_ended(live, ())  # (full blocks get their content keys: names change)
        if wrote and live:  # one write-behind for the step, the pages by their names now
            t = store.spec.page_tokens
            keys = []
            for seq, k in zip(self.seqs, self.tokens):
                if not k or not store.is_live(seq):
                    continue
                kv = seq.kv_len  # (its lengths read at once)
                for layer in wrote:
                    end = kv[layer]  # (a partly filled page: only if asked)
                    stop = -(-end // t) if self._behind_partial else end // t
                    blocks = range((end - k) // t, stop)
                    keys += [page_key(seq.block(b), layer) for b in blocks]
            store.lease_wrote(keys)
        store.turns.charge(time.perf_counter() - t0)
        if ok and self._next == len(self.layers) and self.ahead:
            return [s.seq_id for s in live]
        return []

    def _let_go(self) -> None:
        """The step's room back to the admission and its sequences free (idempotent)."""
        store = self.store
        if self._held is not None and not store.closed:
            store.admission.leave(self._held)
        self._held = None
        self._unclaim()

    def _loads_inline(self) -> bool:
        """Whether the next step's first group (its pages now) would load by a copy that the
        engine runs inline, on this thread, now (the cpu backend's small copies)."""
        store = self.store
        t = store.spec.page_tokens
        first = self.layers[: self.group]
        pages = 0
        for seq in self.seqs:
            kv = seq.kv_len
            pages += sum(-(-kv[layer] // t) for layer in first)
        return store.tiers.engine.runs_inline(pages * store.spec.page_bytes)

    # -- layers ----------------------------------------------------------------------------
    @async_boundary
    async def layer(self, layer: int) -> LayerStep:
        """The next layer of the plan, its pages pinned and its rows built (waits for its
        group's loads when they have not landed). Entering a group lets go of the group
        before it and starts loading the next.

        Raises SpecError (a layer not in the plan, or not the next one: layers run in the
        plan's order), SequenceError (the plan is not active), and what the layer's load
        raised (TierFullError, StoreTimeoutError, UnknownPageError).
        """
        layer = validate.layer(layer, self.store.spec.num_layers)
        i = self._index.get(layer)
        if i is None:
            raise SpecError(f"layer {layer} is not in this step (planned: {self.layers})")
        if not self._active:
            raise SequenceError("the step is not active (use it inside `async with`)")
        if i != self._next:
            want = self.layers[self._next] if self._next < len(self.layers) else None
            raise SpecError(f"layer {layer}: the step's layers run in order, next is {want}")
        self._current = None
        g, at = divmod(i, self.group)
        asked = 0.0  # when compute began to wait for this group's loads (0.0: it did not)
        if at == 0:
            if g:
                self._release(g - 1)
            if self._tasks[g] is None:  # not loaded ahead: its loads start now, compute waits
                asked = time.perf_counter()
            self._start(g)
            if self.ahead and self.window > 1 and g + 1 < len(self._tasks):
                self._start(g + 1)
                nxt = self._tasks[g + 1]
                if nxt is not None and not nxt.done():
                    await asyncio.sleep(0)  # its loads are submitted now, before compute goes on
        task = self._tasks[g]
        assert task is not None  # started above or before
        if at == 0 and not asked and not task.done():
            asked = time.perf_counter()
        if asked:  # its loads are late when their copies ended after it asked (not when the
            steps = await task  # loop, idle between layers under TieredCache, next ran)
            if steps and steps[0].landed > asked:
                late = steps[0].loaded
                self.store.counters.late_fetches += late
                self.waited_pages += late
        steps = await task
        step = steps[at]
        self._next = i + 1
        self._current = step
        return step

    def layer_now(self, layer: int, *, enter: bool = False) -> LayerStep | None:
        """:meth:`layer` with no loop run, for a landed group's layer (else None). A group's
        first only with ``enter``: as :meth:`layer`, it lets go of the group before and starts
        the next (:attr:`starting`: the caller runs its loop a few turns to submit its loads).
        Raises what the release of the group before raises (no error boundary, a frame more
        on every layer call: a load's errors stay in its task, none of the runtime's reach
        here)."""
        i = self._index.get(layer) if type(layer) is int else None
        if i is None or not self._active or i != self._next:
            return None
        g, at = divmod(i, self.group)
        steps = self._landed[g]
        if steps is None:  # (a group's later layers take its steps from here, not its task)
            task = self._tasks[g]
            if task is None or not task.done() or task.cancelled() or task.exception() is not None:
                return None
            steps = self._landed[g] = task.result()
        if at == 0:
            if not enter or self._loop is None:
                return None
            if g:
                self._release(g - 1)
            if (
                self.ahead
                and self.window > 1
                and g + 1 < len(self._tasks)
                and self._tasks[g + 1] is None
            ):
                self._start(g + 1)
                self.starting = self._tasks[g + 1]
        step = steps[at]
        self._next = i + 1
        self._current = step
        return step

    def done_with(self, step: LayerStep) -> None:
        """The caller is done with ``step``, the current layer (its K/V read: gathered, or
        attended). With a window of one group, at its group's last layer: the group is let go
        of (``step`` is no longer current) and the next one loaded here, before the next
        layer asks for it (with no wait where the tier core can; else its task starts,
        :attr:`starting`: the caller runs its loop a few turns). Nothing otherwise: a window
        of two groups loads the next group while this one computes. Raises what the release
        raises (no error boundary: nothing under it raises the runtime's errors)."""
        if self.window != 1 or step is not self._current or not self._active:
            return
        g, at = divmod(self._next - 1, self.group)
        if at != self.group - 1 or g + 1 >= len(self._tasks):
            return
        self._current = None
        self._release(g)
        self._start(g + 1)
        task = self._tasks[g + 1]
        if task is not None and not task.done():
            self.starting = task

    def check_current(self, step: LayerStep) -> None:
        """Raise SequenceError unless ``step`` is the plan's current layer."""
        if step is not self._current:
            raise SequenceError(f"layer {step.layer} is no longer current in this step")

    def _start(self, g: int) -> None:
        if self._tasks[g] is not None:
            return
        loop = self._loop
        try:
            steps = self._load_now(g) if loop is not None else None
        except Exception:  # (nothing held: the task loads it again and raises where the
            steps = None  # layer waits for it, as with any load's error)
        if steps is not None:  # loaded (or resident) and opened here: no task, no loop turn
            assert loop is not None
            done: asyncio.Future[list[LayerStep]] = loop.create_future()
            done.set_result(steps)
            self._tasks[g] = done
            self._landed[g] = steps
            return
        coro = self._load(g)
        self._tasks[g] = loop.create_task(coro) if loop else asyncio.ensure_future(coro)

    async def _load(self, g: int) -> list[LayerStep]:
        """Pin group ``g``'s pages (loading those not resident), open the pages its appends
        need, build its layers' rows. On error nothing stays pinned or opened.

        The pages are named when the group starts and again when a wait let a lease's end
        rename them (see :func:`tierkv.lease.acquire_current`); the new pages and those an
        append fills are never full blocks before it, so no publish renames them."""
        store = self.store
        tiers = store.tiers
        layers = self.layers[g * self.group : (g + 1) * self.group]
        named = [self._name(layers)]

        def name() -> list[bytes]:  # again, by the pages' names now
            named[0] = self._name(layers)
            return named[0][0]

        deadline = tiers.changes.deadline(store.timeout)
        keys, loaded = await acquire_current(tiers, named[0][0], name, self._check_all, deadline)
        landed = tiers.stats.loads_landed_at if loaded else 0.0  # (its copies' end)
        _, new, plans = named[0]
        try:
            slots: list[int] = []
            if new:
                if self._tenants is not None:  # several tenants' pages: room tenant by tenant
                    slots = await reserve_by_tenant(
                        tiers, self._tenants, new, mine=len(keys), timeout=store.timeout
                    )
                else:
                    slots = await tiers.reserve_device(new, mine=len(keys), timeout=store.timeout)
        except BaseException:
            if keys:
                tiers.unpin_device(keys)
            raise
        return self._open(layers, keys, new, plans, slots, loaded, landed)

    def _load_now(self, g: int) -> list[LayerStep] | None:
        """:meth:`_load` with no wait and no task, where the tier core can pin, load and
        open the group's pages at once (the cpu backend's inline copies into room that clean
        pages make: :meth:`LeasePages.acquire_now`); None where it cannot (nothing held
        then: :meth:`_load` does it, and raises what there is to raise)."""
        store = self.store
        tiers = store.tiers
        layers = self.layers[g * self.group : (g + 1) * self.group]
        try:
            keys, new, plans = self._name(layers)
            loaded = tiers.pages.acquire_now(keys, Priority.DEMAND)
        except TierKVError:
            return None
        if loaded is None:
            return None
        landed = tiers.stats.loads_landed_at if loaded else 0.0
        try:
            if not new:
                slots: list[int] | None = []
            elif self._tenants is not None:  # several tenants' pages: room tenant by tenant
                slots = reserve_now_by_tenant(tiers, self._tenants, new)
            else:
                slots = tiers.pages.reserve_now(new)
        except TierKVError:  # (raised again by _load, where the layer waits)
            slots = None
        if slots is None:
            if keys:
                tiers.unpin_device(keys)
            return None
        return self._open(layers, keys, new, plans, slots, loaded, landed)

    def _open(
        self,
        layers: tuple[int, ...],
        keys: list[bytes],
        new: list[bytes],
        plans: list[LayerPages],
        slots: list[int],
        loaded: int,
        landed: float,
    ) -> list[LayerStep]:
        """A group's pages pinned (``keys``) and its new pages reserved (``slots``): open the
        new pages, build the layers' rows. On error nothing stays pinned or opened."""
        store = self.store
        tiers = store.tiers
        t = store.spec.page_tokens
        opened = bool(new)
        pinned = owned = False
        try:
            if new:
                tiers.pages.zero_device(slots)  # a reused slot holds another page's bytes
                tiers.commit_device(new)
                tiers.pin_device(new)
                pinned = True
                tiers.ownership.own(new)
                owned = True
            # the slots of the pages read, then of the new ones: one lookup
            slots_of = tiers.pages.device_slots(keys + new if new else keys) if keys or new else []
            nk = len(keys)
            device = tiers.pages.device
            spec, tokens, per_slot = store.spec, self.tokens, self._per_slot
            steps = []
            index = array("q")  # every layer's slots, sequence after sequence: one tensor
            counts = []
            end = (nk, len(new))
            for j, layer in enumerate(layers):
                at, at_new, starts, need, filled, written = plans[j]
                k1, n1 = plans[j + 1][:2] if j + 1 < len(plans) else end
                per_seq = []
                for start, want in zip(starts, need):
                    have = -(-start // t)
                    grown = want - have
                    got = slots_of[at : at + have]
                    if grown:
                        got += slots_of[nk + at_new : nk + at_new + grown]
                    per_seq.append(got)
                    index.extend(got)
                    at += have
                    at_new += grown
                counts.append(len(index))
                rows = LayerRows(per_seq, starts, tokens, per_slot, spec, device)
                steps.append(
                    LayerStep(
                        self,
                        layer,
                        keys[plans[j][0] : k1],
                        new[plans[j][1] : n1],
                        filled,
                        written,
                        starts,
                        rows,
                    )
                )
            if index:  # each layer's page index a slice of one tensor (not one build a layer)
                whole = torch.frombuffer(index, dtype=torch.int64)
                if device.type != "cpu":
                    whole = whole.to(device)
                sizes = [b - a for a, b in zip([0, *counts], counts)]
                for step, part in zip(steps, whole.split(sizes)):  # (one call for the views)
                    step.rows.set_page_index(part)
        except BaseException:
            if opened:
                tiers.abort_device(new, pinned=pinned, owned=owned)
            if keys:
                tiers.unpin_device(keys)
            raise
        c = store.counters
        c.pages_leased += len(keys)
        c.device_hits += len(keys) - loaded
        if steps:
            steps[0].loaded = loaded
            steps[0].landed = landed
        store.lease_began(keys)
        return steps

    def _release(self, g: int) -> None:
        """Let go of group ``g``: its pins, the new pages of layers not appended to. Idempotent;
        nothing for a group whose load did not succeed."""
        task = self._tasks[g]
        if self._released[g] or task is None or not task.done() or task.cancelled():
            return
        self._released[g] = True
        if task.exception() is not None:
            return
        tiers = self.store.tiers
        pins: list[bytes] = []
        written: list[bytes] = []
        filled: list[bytes] = []
        for step in task.result():
            if step.appended:
                pins += step.keys + step.new
                written += step.written
                filled += step.filled
                if any(self.tokens):
                    self._wrote.append(step.layer)
            else:  # never appended to: the pages it opened go
                tiers.abort_device(step.new, pinned=True, owned=True)
                pins += step.keys
        if written:  # the appends' pages, newer than their lower copies (before the unpin:
            # a write-behind that copied one meanwhile, pinned, leaves it dirty now)
            tiers.pages.mark_dirty(written)
        if filled:  # their bytes are final: their CRC-32C, in one native call for the group
            tiers.pages.seal(filled)
        if pins:
            tiers.unpin_device(pins)
            # their use, now: by the names they have now (a lease's end may rename them later)
            self.store.lease_ended((), pins)

    def _name(self, layers: tuple[int, ...]) -> GroupPages:
        """A group's pages by their current names (:func:`tierkv.step_plan.group_pages`).
        Raises SequenceError when a sequence of the plan was released."""
        self._check_all()
        return group_pages(
            self.seqs, self.tokens, layers, self.store.spec.page_tokens, self.store.tenants
        )

    def _check_all(self) -> None:
        for seq in self.seqs:
            self._check_live(seq)

    def _check_live(self, seq: SequenceState) -> None:
        if not self.store.is_live(seq):
            raise SequenceError(f"sequence {seq.seq_id!r} was released")
