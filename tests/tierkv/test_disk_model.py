"""Model-based test of the disk medium: random writes, frees, reads, bit flips and reopens
against a model of what must and may be on disk. Every read is bit-exact or a miss; a page
stored, not freed and not damaged is a hit, across reopens for content keys."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from tierkv.disk import DiskPages, StoreStatus
from tierkv.disk.layout import ALIGN

sys.path.insert(0, str(Path(__file__).parent))
from disk_util import flip_bits, key, open_disk, page, read_sync, slot_offset, write_sync

PAGE = 4096
SLOTS = 6
KEYS = [key(i) for i in range(8)] + [key(100 + i, private=True) for i in range(3)]
ids = st.lists(st.integers(0, len(KEYS) - 1), min_size=1, max_size=5)


class DiskModel(RuleBasedStateMachine):
    """The disk against a model: `must` (stored, intact: a read hits) and `damaged` (a read
    misses); any other key may hit or miss, but a hit is always the key's own bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tierkv-disk-model-"))
        self.disk = self._open()
        self.must: set[bytes] = set()
        self.flipped: dict[bytes, set[tuple[int, int]]] = {}  # bits flipped in a key's slot

    @property
    def damaged(self) -> set[bytes]:
        """Keys whose slot has bits flipped (a bit flipped twice is whole again)."""
        return {k for k, bits in self.flipped.items() if bits}

    def _open(self) -> DiskPages:
        return open_disk(self.dir, slots=SLOTS, page_bytes=PAGE)

    @rule(pick=ids)
    def write(self, pick: list[int]) -> None:
        keys = [KEYS[i] for i in pick]
        for k, s in zip(keys, write_sync(self.disk, keys), strict=True):
            assert s is not StoreStatus.FAILED
            if s is StoreStatus.STORED:
                self.must.add(k)
                self.flipped.pop(k, None)
            elif s is StoreStatus.PRESENT and k not in self.damaged:
                self.must.add(k)  # held (perhaps a content page back after a reopen): a hit

    @rule(pick=ids)
    def free(self, pick: list[int]) -> None:
        keys = [KEYS[i] for i in pick]
        self.disk.free(keys)
        self.must.difference_update(keys)  # a damaged page stays damaged: it may come back

    @rule(pick=ids)
    def read(self, pick: list[int]) -> None:
        self._read([KEYS[i] for i in pick])

    @rule()
    def read_all(self) -> None:
        self._read(KEYS)

    def _read(self, keys: list[bytes]) -> None:
        before = self.disk.stats().corrupt_pages
        indexed = {k for k, s in zip(keys, self.disk.lookup(keys), strict=True) if s is not None}
        hits, out = read_sync(self.disk, keys)
        for k, h, o in zip(keys, hits, out, strict=True):
            if h:
                assert (o == page(k, PAGE)).all(), "wrong bytes served"
                assert k not in self.damaged, "a damaged page was served"
            else:
                assert k not in self.must, "a stored page was lost"
        held = indexed & self.damaged  # read, found damaged, dropped (a freed one may come back)
        found = {k for k, s in zip(keys, self.disk.lookup(keys), strict=True) if s is not None}
        assert not found & held, "a damaged page is still held after its read"
        assert self.disk.stats().corrupt_pages - before <= len(held)  # each counted once
        for k in held:
            self.flipped.pop(k, None)

    @rule(n=st.integers(0, SLOTS), where=st.integers(0, ALIGN + PAGE), bit=st.integers(0, 7))
    def flip(self, n: int, where: int, bit: int) -> None:
        held = [k for k, s in zip(KEYS, self.disk.lookup(KEYS), strict=True) if s is not None]
        if not held:
            return
        k = held[n % len(held)]
        (slot,) = self.disk.lookup([k])
        assert slot is not None
        g = self.disk.geometry
        f, base = slot_offset(self.dir, slot, g.slots_per_segment, g.slot_bytes)
        offset = where if where < 76 else ALIGN + (where % PAGE)  # header fields or payload
        flip_bits(f, [(base + offset, bit)])
        self.must.discard(k)
        self.flipped.setdefault(k, set()).symmetric_difference_update({(offset, bit)})

    @rule()
    def reopen(self) -> None:
        self.disk.close()
        self.disk = self._open()
        self.must = {k for k in self.must if not k[0] & 0x80}  # private pages are gone

    @invariant()
    def consistent(self) -> None:
        self.disk.check()
        s = self.disk.stats()
        assert s.used + s.free + s.reserved == SLOTS

    def teardown(self) -> None:
        self.disk.close()
        shutil.rmtree(self.dir, ignore_errors=True)


DiskModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_disk_model = DiskModel.TestCase
