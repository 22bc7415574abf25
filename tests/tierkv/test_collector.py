"""settle_collector and restore_collector; per-sequence bookkeeping the collector need not walk."""

from __future__ import annotations

import gc

import pytest
import torch

import tierkv
from tierkv import KVSpec
from tierkv.collector import SERVER_THRESHOLDS, restore_collector, settle_collector
from tierkv.errors import InvalidInputError
from tierkv.store import KVStore


def test_settle_then_restore() -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    prev = tierkv.settle_collector()
    try:
        assert gc.get_threshold() == SERVER_THRESHOLDS
        assert prev.thresholds == before and prev.frozen_before == frozen
        assert gc.get_freeze_count() >= frozen and gc.isenabled()
    finally:
        tierkv.restore_collector(prev)
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0


def test_settle_restores_a_disabled_collector() -> None:
    gc.disable()
    try:
        prev = settle_collector((5000, 10, 10))
        assert gc.get_threshold() == (5000, 10, 10) and gc.isenabled()
        restore_collector(prev)
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "bad", [(0, 10, 10), (700, 10), (700.0, 10, 10), (True, 1, 1), "700", None, 700]
)
def test_bad_thresholds_are_refused_before_anything_changes(bad: object) -> None:
    before = gc.get_threshold()
    with pytest.raises(InvalidInputError, match="thresholds"):
        settle_collector(bad)  # type: ignore[arg-type]
    assert gc.get_threshold() == before


async def test_a_sequence_adds_the_same_few_references_whatever_its_length() -> None:
    """A sequence's token ids are one flat array: a full collector pass visits a handful of
    references per sequence, not one per token."""
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="fp16", page_tokens=16)
    async with KVStore(spec, device_bytes=1 << 20, host_bytes=1 << 22) as store:
        refs = []
        for n in (16, 4000):
            await store.add_sequence(f"s{n}", list(range(n)))
            seq = store.sequence(f"s{n}")
            containers = [seq, seq.token_ids, seq.blocks, seq.shared, seq.kv_len]
            refs.append(sum(len(gc.get_referents(c)) for c in containers if gc.is_tracked(c)))
            assert seq.tokens == list(range(n)) and seq.num_tokens == n
        assert refs[1] == refs[0] < 40


async def test_a_sequence_with_kv_is_one_tracked_object() -> None:
    """Tokens, block keys, the shared flags and the KV lengths live in flat byte buffers the
    collector does not track: a live sequence adds its state object alone to a full pass."""
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="fp16", page_tokens=16)
    async with KVStore(spec, device_bytes=1 << 20, host_bytes=1 << 22) as store:
        await store.add_sequence("s", list(range(40)))
        k = torch.zeros(1, 40, 8, dtype=torch.float16)
        async with store.lease(["s"]) as lease:
            for layer in range(2):
                await lease.append("s", layer, k, k)
        seq = store.sequence("s")
        assert seq.num_blocks == 3 and seq.kv_len == [40, 40] and seq.tokens == list(range(40))
        assert gc.is_tracked(seq)
        inner = [o for o in gc.get_referents(seq) if gc.is_tracked(o) and o is not type(seq)]
        assert inner == [], inner
        assert all(seq.shared[:2]) and not seq.shared[2]  # two full blocks got content keys
        assert seq.blocks[0] == seq.block(0) and len(seq.all_pages()) == 6


def test_restore_collector_refuses_what_settle_did_not_give() -> None:
    """restore_collector("junk") was an AttributeError; now InvalidTypeError, nothing changed."""
    import gc

    from tierkv.errors import InvalidTypeError

    before = gc.get_threshold(), gc.isenabled()
    with pytest.raises(InvalidTypeError, match="settle_collector"):
        restore_collector("junk")  # type: ignore[arg-type]
    assert (gc.get_threshold(), gc.isenabled()) == before
