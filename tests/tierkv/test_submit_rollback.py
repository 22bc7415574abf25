"""A tier-core move whose engine job cannot be queued (the engine closed under it) undoes the
state it took before the submit: host slots reserved by an import, host pins of an export, cold
slots of a compression. Issue 25 found the import's hole (its slots stayed WRITING forever);
these are the rest of its family."""

from __future__ import annotations

from typing import Any

import pytest

from tierkv import KVSpec
from tierkv.keys import PAGE_KEY_BYTES
from tierkv.page_table import PageState
from tierkv.runtime import EngineClosedError
from tierkv.store import KVStore
from tierkv.tiers import COLD, HOST

SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes


def _refuse(*_: object, **__: object) -> Any:
    raise EngineClosedError("transfer engine is closed")


def _nothing_stuck(store: KVStore) -> None:
    store.check()
    table = store.tiers.table
    for tier in table.tier_names:
        for k in table.keys(tier):
            assert table.state(k, tier) is PageState.READABLE, (tier, k.hex())
            assert table.pins(k, tier) == 0, (tier, k.hex())


async def _host_pages(store: KVStore, n: int) -> list[bytes]:
    keys = [bytes([i]) * PAGE_KEY_BYTES for i in range(1, n + 1)]

    async def load(new: list[bytes], host: Any, slots: list[int]) -> int:
        for s in slots:
            host[s] = 7
        return len(new)

    assert await store.tiers.glue.import_host(keys, load) == n
    return keys


@pytest.mark.parametrize("move", ["import", "export", "compress"])
async def test_a_move_that_cannot_be_queued_leaves_no_state_behind(
    move: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with KVStore(
        SPEC, device_bytes=4 * PAGE, host_bytes=16 * PAGE, codec="none", cold_fraction=0.5
    ) as store:
        tiers = store.tiers
        keys = await _host_pages(store, 3)
        monkeypatch.setattr(tiers.engine, "submit_async", _refuse)
        monkeypatch.setattr(tiers.engine, "submit_call", _refuse)
        with pytest.raises(EngineClosedError):
            if move == "import":
                await tiers.glue.import_host([b"\x55" * PAGE_KEY_BYTES], lambda *a: _refuse())
            elif move == "export":
                await tiers.glue.export_host(keys, lambda *a: _refuse())
            else:
                await tiers.cold.compress_idle(keys)
        monkeypatch.undo()
        _nothing_stuck(store)
        assert tiers.table.present(keys, HOST) == keys
        assert tiers.table.present(keys, COLD) == []
