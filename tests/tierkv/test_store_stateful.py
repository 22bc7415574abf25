"""A model-based stateful test of KVStore (issue 13): whatever the calls, their interleaving and
their cancellation, every KV read is bit-exact and the store's invariants hold.

The reference model is what a model computes: the KV of token ``i`` in layer ``l`` is a function
of the prompt prefix ``tokens[: i + 1]`` alone, so a cached prefix reused by another sequence
must read back exactly the KV that sequence would have appended itself. Tiny tiers force every
path (eviction with write-back, host -> cold, loads, waiting for room, renames at lease end).

A remote tier (a dict behind the ``PageSource`` protocol) is drawn in half the runs; a
``flood`` request pushes cached prefixes out of the host tier into it, and later prompts import
them back. Run longer with ``HYPOTHESIS_PROFILE=long`` (see tests/conftest.py):
``HYPOTHESIS_LONG_EXAMPLES=4000`` runs ~10^5 steps in about 6 minutes on two cores.

Issue 23 added appends cancelled at any await inside a lease (their bytes and the KV length
change together or not at all), two leases of one sequence at once, and a bit-exact read of
every live sequence after each step. With the issue's lease and write-back fixes reverted, the
random search (no shrinking) first failed after 92,381 steps (a lease read a page another lease
of its sequence had added, which had left the device): the long profile's 10^5 examples of up
to 30 steps reach that; CI's 25 derandomized examples do not, tests/tierkv/test_store_races.py
replays each race deterministically.

Issue 25 added a disk tier (a temporary directory of a dozen slots) in half the runs, and a
``restart`` rule: every sequence released, the store closed and a new one opened on the same
directory; prompts then reuse the prefixes the disk kept, every KV read bit-exact or a miss.
The host-first machine also chains the mmap tier (a plug-in, tierkv.mmap_tier) in half its runs:
scratch, its pages are misses after a restart, its reads bit-exact or a (verified) miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tierkv import Cold, Disk, Host, KVSpec, Remote, SequenceError, TierFullError
from tierkv.keys import KeyKind, key_kind
from tierkv.mmap_tier import Mmap
from tierkv.page_table import PageState
from tierkv.store import KVStore
from tierkv.tiers import DEVICE

sys.path.insert(0, str(Path(__file__).parent))
from dict_source import DictSource

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
MAX_TOKENS = 12  # 3 blocks x 2 layers: a lease of one sequence always fits a 6-page device
IDS = ["a", "b", "c"]
PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7],
    [1, 2, 3, 4, 5, 6, 7, 8, 9],  # shares one block with the first
    [1, 2, 3, 4, 9],
    [7, 7, 7, 7, 7, 7, 7, 7, 7, 7],
    [3],
]
LAYER_SETS = [[0], [1], [0, 1]]
DISK_SLOT = 4096 + -(-PAGE // 4096) * 4096  # a disk slot: its header and the page, 4 KiB each
DISK_SLOTS = 12
_KV: dict[tuple[bytes, int], torch.Tensor] = {}
STEPS = [0]  # steps run in this process (the long profile reports how many found a bug)


def kv_of(prefix: list[int], layer: int) -> torch.Tensor:
    """K and V of the last token of ``prefix`` in ``layer``: ``[2, H, 1, D]``, a function of
    the prefix alone."""
    h = hashlib.blake2b(repr(prefix).encode(), digest_size=8).digest()
    out = _KV.get((h, layer))
    if out is None:
        g = torch.Generator().manual_seed(int.from_bytes(h, "little") ^ layer)
        out = torch.randn((2, SPEC.num_kv_heads, 1, SPEC.head_dim), generator=g)
        _KV[(h, layer)] = out
    return out


def expected(tokens: list[int], layer: int, start: int, end: int) -> torch.Tensor:
    """``[2, H, end - start, D]``: the KV of tokens ``start:end``."""
    if end <= start:
        return torch.empty((2, SPEC.num_kv_heads, 0, SPEC.head_dim))
    return torch.cat([kv_of(tokens[: i + 1], layer) for i in range(start, end)], dim=2)


class Model:
    """What each live sequence holds: its tokens and the KV length of each layer."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.kv_len: dict[str, list[int]] = {}


class StoreMachine(RuleBasedStateMachine):
    """KVStore against :class:`Model`, on a private event loop."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.model = Model()
        self.store: KVStore | None = None
        self.config: dict[str, Any] = {}
        self.disk_dir: str | None = None

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def attempt(self, coro: Any) -> None:
        """Run a lease operation. The one error it may raise is a host tier full of live
        sequences' pages (a tiny host and no live compression): the invariants checked after
        the step then show that the failure changed nothing it should not have."""
        try:
            self.run(coro)
        except TierFullError as exc:
            if "host tier full" not in str(exc):
                raise

    @property
    def s(self) -> KVStore:
        assert self.store is not None
        return self.store

    @initialize(
        device=st.integers(6, 9),
        host=st.integers(22, 36),
        cold=st.sampled_from([None, "none"]),
        write_behind=st.booleans(),
        compress_live=st.booleans(),
        remote=st.booleans(),
        disk=st.booleans(),
    )
    def open_store(
        self,
        device: int,
        host: int,
        cold: str | None,
        write_behind: bool,
        compress_live: bool,
        remote: bool,
        disk: bool,
    ) -> None:
        if disk:  # a small disk: its own eviction runs too
            self.disk_dir = tempfile.mkdtemp(prefix="tierkv-stateful-")
        if remote:  # a host tier that drops cached prefixes, so that they go to the remote
            cold, host = None, host - 8
        elif disk:  # a host tier that evicts cached prefixes to disk
            host -= 8
        self.config = dict(
            device_bytes=device * PAGE,
            host_bytes=host * PAGE,
            codec=cold,
            cold_fraction=0.3,
            compress_after=1,
            compress_live=compress_live,
            write_behind=write_behind,
            timeout=5.0,
            remote=DictSource() if remote else None,
            disk_path=self.disk_dir,
            disk_bytes=DISK_SLOTS * DISK_SLOT if disk else None,
        )
        self.store = self.run(KVStore(SPEC, **self.config).open())

    # -- operations --------------------------------------------------------------------
    async def _append(self, sid: str, layers: list[int], n: int, done: list[int]) -> None:
        """Lease ``sid`` on ``layers``, bring every layer to ``target`` tokens, read back."""
        m = self.model
        tokens = m.tokens[sid]
        target = min(max(m.kv_len[sid]) + n, MAX_TOKENS, len(tokens))
        async with self.s.lease([sid], layers) as lease:
            for layer in layers:
                start = m.kv_len[sid][layer]
                if target > start:
                    ref = expected(tokens, layer, start, target)
                    await lease.append(sid, layer, ref[0], ref[1])
                    m.kv_len[sid][layer] = target  # only once the append returned
                done.append(layer)
            self._compare(lease, sid, layers)

    async def _extend(self, lease: Any, sid: str, layer: int, n: int) -> None:
        """Append the KV of up to ``n`` more tokens of ``sid`` to ``layer`` (the model follows
        once the append returned)."""
        m = self.model
        start = m.kv_len[sid][layer]
        target = min(start + n, MAX_TOKENS, len(m.tokens[sid]))
        if target > start:
            ref = expected(m.tokens[sid], layer, start, target)
            await lease.append(sid, layer, ref[0], ref[1])
            m.kv_len[sid][layer] = target

    def _compare(self, lease: Any, sid: str, layers: list[int]) -> None:
        tokens = self.model.tokens[sid]
        for layer in layers:
            n = self.model.kv_len[sid][layer]
            k, v = lease.kv(sid, layer)
            want = expected(tokens, layer, 0, n)
            assert torch.equal(k, want[0]) and torch.equal(v, want[1]), (sid, layer, n)

    async def _read(self, sid: str, layers: list[int]) -> None:
        async with self.s.lease([sid], layers) as lease:
            self._compare(lease, sid, layers)

    def _grow(self, sid: str, n: int) -> None:
        """Declare generated tokens (a deterministic continuation, so blocks get shared)."""
        tokens = self.model.tokens[sid]
        want = min(max(self.model.kv_len[sid]) + n, MAX_TOKENS)
        new = [(len(tokens) + i) % 3 + 1 for i in range(max(0, want - len(tokens)))]
        if new:
            self.s.add_tokens(sid, new)
            tokens.extend(new)

    # -- rules -------------------------------------------------------------------------
    @rule(sid=st.sampled_from(IDS), prompt=st.sampled_from(PROMPTS))
    def add_sequence(self, sid: str, prompt: list[int]) -> None:
        if sid in self.model.tokens:
            try:
                self.run(self.s.add_sequence(sid, prompt))
            except SequenceError:
                return
            raise AssertionError("a live id was added twice")
        cached = self.run(self.s.add_sequence(sid, prompt))
        t = SPEC.page_tokens
        assert cached % t == 0 and cached <= max(0, len(prompt) - 1)
        self.model.tokens[sid] = list(prompt)
        self.model.kv_len[sid] = [cached] * SPEC.num_layers

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data(), layers=st.sampled_from(LAYER_SETS), n=st.integers(1, 5))
    def lease_append_read(self, data: st.DataObject, layers: list[int], n: int) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model.tokens)))
        self._grow(sid, n)
        self.attempt(self._append(sid, layers, n, []))

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data(), layers=st.sampled_from(LAYER_SETS))
    def read(self, data: st.DataObject, layers: list[int]) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model.tokens)))
        self.attempt(self._read(sid, layers))

    @precondition(lambda self: len(self.model.tokens) >= 2)
    @rule(data=st.data(), n=st.integers(1, 4))
    def concurrent(self, data: st.DataObject, n: int) -> None:
        """Two sequences at once: an append on one, a read of the other (they may wait)."""
        a, b = data.draw(st.permutations(sorted(self.model.tokens)))[:2]
        self._grow(a, n)

        async def both() -> None:
            res = await asyncio.gather(
                self._append(a, [0, 1], n, []), self._read(b, [0, 1]), return_exceptions=True
            )
            for r in res:  # both have ended: the model is settled
                if isinstance(r, BaseException):
                    raise r

        self.attempt(both())

    @precondition(lambda self: self.model.tokens)
    @rule(
        data=st.data(),
        layers=st.sampled_from(LAYER_SETS),
        n=st.integers(1, 5),
        after=st.integers(0, 12),
        write=st.booleans(),
    )
    def cancelled(
        self, data: st.DataObject, layers: list[int], n: int, after: int, write: bool
    ) -> None:
        """Cancel a lease (with appends or reads) after ``after`` loop turns."""
        sid = data.draw(st.sampled_from(sorted(self.model.tokens)))
        self._grow(sid, n)

        async def go() -> None:
            done: list[int] = []
            coro = self._append(sid, layers, n, done) if write else self._read(sid, layers)
            task = asyncio.ensure_future(coro)
            for _ in range(after):
                await asyncio.sleep(0)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        self.attempt(go())

    @precondition(lambda self: self.model.tokens)
    @rule(
        data=st.data(),
        layer=st.integers(0, SPEC.num_layers - 1),
        n=st.integers(1, 6),
        after=st.integers(0, 8),
    )
    def cancelled_append(self, data: st.DataObject, layer: int, n: int, after: int) -> None:
        """Inside a lease, cancel one append after ``after`` loop turns (at any await in it):
        its bytes and the KV length change together or not at all, and the lease reads
        bit-exact KV right after (issue 23)."""
        sid = data.draw(st.sampled_from(sorted(self.model.tokens)))
        self._grow(sid, n)

        async def go() -> None:
            m = self.model
            tokens, seq = m.tokens[sid], self.s.sequence(sid)
            async with self.s.lease([sid]) as lease:
                start = m.kv_len[sid][layer]
                target = min(start + n, MAX_TOKENS, len(tokens))
                if target > start:
                    ref = expected(tokens, layer, start, target)
                    task = asyncio.ensure_future(lease.append(sid, layer, ref[0], ref[1]))
                    for _ in range(after):
                        await asyncio.sleep(0)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    if not task.cancelled():
                        m.kv_len[sid][layer] = target
                assert seq.kv_len_of(layer) == m.kv_len[sid][layer], "bytes and length apart"
                self._compare(lease, sid, list(range(SPEC.num_layers)))

        self.attempt(go())

    @precondition(  # two leases of one layer (4 pages each at most) are admitted at once
        lambda self: self.model.tokens and self.s.tiers.table.capacity(DEVICE) >= 8
    )
    @rule(
        data=st.data(),
        n=st.integers(1, 5),
        m=st.integers(1, 5),
        after=st.integers(0, 10),
        which=st.sampled_from(["none", "first", "second"]),
        squeeze=st.booleans(),
    )
    def two_leases_one_sequence(
        self, data: st.DataObject, n: int, m: int, after: int, which: str, squeeze: bool
    ) -> None:
        """Two leases of one sequence at once (issue 23): the later-entered one appends to a
        page the first one added after it began (which its end let go of, and which a lease
        of another sequence may ``squeeze`` off the device meanwhile), both read back, and
        ``which`` of them is cancelled at a random await."""
        sid = data.draw(st.sampled_from(sorted(self.model.tokens)))
        self._grow(sid, n + m)
        model = self.model

        async def first_one() -> None:
            async with self.s.lease([sid], [0]) as lease:
                await self._extend(lease, sid, 0, n)
                self._compare(lease, sid, [0])

        async def second_one(entered: asyncio.Event, go_on: asyncio.Event) -> None:
            try:
                async with self.s.lease([sid], [0]) as lease:
                    entered.set()
                    await go_on.wait()
                    await self._extend(lease, sid, 0, m)
                    with contextlib.suppress(SequenceError):  # its KV left the device
                        self._compare(lease, sid, [0])
            finally:  # entered, failed or cancelled: the first goes on
                entered.set()

        async def go() -> None:
            entered, go_on = asyncio.Event(), asyncio.Event()
            second = asyncio.ensure_future(second_one(entered, go_on))
            await entered.wait()
            first = asyncio.ensure_future(first_one())
            victim = {"first": first, "second": second}.get(which)
            if victim is not None:
                for _ in range(after):
                    await asyncio.sleep(0)
                victim.cancel()
            done = await asyncio.gather(first, return_exceptions=True)
            others = sorted(set(model.tokens) - {sid})
            if squeeze and others and not second.done():  # the first's new page may go
                await asyncio.gather(self._read(others[0], [0]), return_exceptions=True)
            go_on.set()
            res = done + await asyncio.gather(second, return_exceptions=True)
            for r in res:
                if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError):
                    raise r
            assert self.s.sequence(sid).kv_len_of(0) == model.kv_len[sid][0]

        self.attempt(go())

    @precondition(lambda self: self.model.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.model.tokens)))
        self.run(self.s.release(sid))
        del self.model.tokens[sid], self.model.kv_len[sid]

    @rule(seed=st.integers(0, 10_000))
    def flood(self, seed: int) -> None:
        """A short-lived request with a prompt of its own: its cached blocks push older
        cached prefixes out of the host tier (to the remote tier, when there is one)."""
        prompt = [100 + (seed * 13 + i) % 997 for i in range(MAX_TOKENS)]

        async def go() -> None:
            await self.s.add_sequence("flood", prompt)
            seq = self.s.sequence("flood")
            try:
                async with self.s.lease(["flood"]) as lease:
                    for layer in range(SPEC.num_layers):
                        ref = expected(prompt, layer, seq.kv_len[layer], len(prompt))
                        await lease.append("flood", layer, ref[0], ref[1])
            finally:
                await self.s.release("flood")

        self.attempt(go())

    @rule(ids=st.lists(st.sampled_from(IDS), max_size=3, unique=True), steps=st.integers(1, 3))
    def schedule_and_step(self, ids: list[str], steps: int) -> None:
        async def go() -> None:  # (background work is spawned on the running loop)
            self.s.schedule([[s] for s in ids])
            for _ in range(steps):
                self.s.step()
            await asyncio.sleep(0)

        self.run(go())

    @precondition(lambda self: self.disk_dir is not None)
    @rule()
    def restart(self) -> None:
        """Close the store and open a new one on the same disk directory (the remote tier's
        dict, like the disk, outlives the store)."""
        self.run(self._release_all())
        self.run(self.s.close())
        self.model = Model()
        self.store = None
        self.store = self.run(KVStore(SPEC, **self.config).open())
        assert self.s.stats()["disk"]["corrupt_pages"] == 0

    @rule()
    def drain(self) -> None:
        self.run(self.s.drain())

    # -- invariants --------------------------------------------------------------------
    @invariant()
    def holds(self) -> None:
        if self.store is None:
            return
        STEPS[0] += 1
        self.s.check()
        adm = self.s.admission
        assert adm.active == 0 and adm.waiting == 0 and adm.committed == 0
        for sid in sorted(self.model.tokens):  # every live sequence reads back bit-exact
            assert self.s.sequence(sid).kv_len == self.model.kv_len[sid], sid
            self.attempt(self._read(sid, list(range(SPEC.num_layers))))

    def teardown(self) -> None:
        try:
            if self.store is not None:
                self.run(self._release_all())
        finally:
            if self.store is not None:
                self.run(self.s.close())
            self.loop.close()
            if self.disk_dir is not None:
                shutil.rmtree(self.disk_dir, ignore_errors=True)

    async def _release_all(self) -> None:
        store = self.s
        for sid in list(self.model.tokens):
            await store.release(sid)
        await store.drain()
        if "disk" in store.stats():
            store._chain.tiers[0].pages.check()  # type: ignore[union-attr]
        for _ in range(5):
            await asyncio.sleep(0.001)
        store.check()
        tiers = store.tiers
        table = tiers.table
        assert (
            not tiers.ownership.owners
            and not tiers.ownership.owner_pins
            and not tiers.ownership.doomed
        )
        for t in table.tier_names:
            for k in table.keys(t):
                assert table.state(k, t) == PageState.READABLE, ("stuck", t, k.hex())
                assert table.pins(k, t) == 0, ("pinned", t, k.hex())
                assert key_kind(k[:16]) is KeyKind.CONTENT, ("private page left", t, k.hex())
        assert table.used(DEVICE) <= table.capacity(DEVICE)


class HostFirstMachine(StoreMachine):
    """The same model on a host-first store (issue 25): ``tiers=[Host, Cold?, Disk?, Remote?]``,
    no device tier; leases pin pages in host memory, the owners pin the pages of live
    sequences there (their one exact copy), cached prefixes leave to cold, disk and remote."""

    map_dir: str | None = None

    @initialize(
        host=st.integers(20, 30),
        cold=st.booleans(),
        remote=st.booleans(),
        disk=st.booleans(),
        mapped=st.booleans(),
    )
    def open_store(  # type: ignore[override]
        self, host: int, cold: bool, remote: bool, disk: bool, mapped: bool
    ) -> None:
        tiers: list[Any] = [Host(bytes=host * PAGE)]
        if cold:
            tiers.append(Cold(codec="none", bytes=12 * (PAGE + 128)))
        if disk:
            self.disk_dir = tempfile.mkdtemp(prefix="tierkv-stateful-")
            tiers.append(Disk(path=self.disk_dir, bytes=DISK_SLOTS * DISK_SLOT))
        if mapped:  # the plug-in tier (tierkv.mmap_tier): scratch, a miss after a restart
            self.map_dir = tempfile.mkdtemp(prefix="tierkv-stateful-map-")
            tiers.append(Mmap(path=Path(self.map_dir, "kv.map"), bytes=DISK_SLOTS * PAGE))
        if remote:
            tiers.append(Remote(sources=[DictSource()]))
        self.config = dict(
            tiers=tiers,
            compress_after=1,  # (compress_live needs a device tier: refused here)
            timeout=5.0,
        )
        self.store = self.run(KVStore(SPEC, **self.config).open())

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            if self.map_dir is not None:
                shutil.rmtree(self.map_dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
TestStoreModel = StoreMachine.TestCase
HostFirstMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=30, deadline=None
)
TestHostFirstStoreModel = HostFirstMachine.TestCase
