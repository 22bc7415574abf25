"""A stream copy that hangs: the copies out of one tier wait for a gate (a stuck stream, or a
copy held in flight while the test looks at the store). Small cpu copies run inline on the
loop's thread unless ``TIERKV_INLINE_COPIES=0``: set it before the store opens."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tierkv.store import KVStore


def hold_copies(monkeypatch: pytest.MonkeyPatch, store: KVStore, tier: str) -> threading.Event:
    """Copies out of ``tier`` wait (at most 20 s) until the returned gate opens."""
    gate = threading.Event()
    backend = store.tiers.engine.backend
    copy = backend.copy_slots

    def held(src: Any, *args: Any) -> Any:
        if src.name == tier:
            gate.wait(20)
        return copy(src, *args)

    monkeypatch.setattr(backend, "copy_slots", held)
    return gate
