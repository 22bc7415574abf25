"""Pin counts (and states) of many slots at once (:mod:`tierkv.page_table`): a step pins and
unpins a few thousand pages per layer group, and a Python loop per slot cost it ~1 ms a call.
Below ``SMALL`` slots the loop is cheaper than numpy's setup and stays.

Pins live in an ``array('l')`` and states in a ``bytearray`` (untracked by the collector);
numpy reads and writes them in place through ``np.frombuffer``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["SMALL", "add_pins", "drop_pins", "set_states"]

SMALL = 192  # (measured: the loop and numpy break even at 128-256 slots)


def _view(pins: array[int]) -> npt.NDArray[np.signedinteger]:
    return np.frombuffer(pins, dtype=f"i{pins.itemsize}")


def add_pins(pins: array[int], slots: Sequence[int]) -> int:
    """Pin each of ``slots`` once more (a slot named twice, twice); returns how many distinct
    slots were unpinned before."""
    if len(slots) < SMALL:
        newly = 0
        for s in slots:
            p = pins[s]
            if not p:
                newly += 1
            pins[s] = p + 1
        return newly
    view = _view(pins)
    uniq, counts = np.unique(np.asarray(slots, dtype=np.intp), return_counts=True)
    cur = view[uniq]
    view[uniq] = cur + counts
    return int(np.count_nonzero(cur == 0))


def drop_pins(
    pins: array[int], slots: Sequence[int], state: bytearray, readable: int
) -> tuple[int | None, int]:
    """Unpin each of ``slots`` once (a slot named twice, twice). Returns ``(bad, freed)``:
    ``bad`` the index in ``slots`` of a slot with fewer pins than it is named (then nothing
    changed), else None; ``freed`` the distinct slots left unpinned whose ``state`` is
    ``readable``."""
    if len(slots) < SMALL:
        freed = 0
        for i, s in enumerate(slots):
            p = pins[s]
            if not p:
                for done in slots[:i]:  # roll back: nothing changes on error
                    pins[done] += 1
                return i, 0
            pins[s] = p - 1
            if p == 1 and state[s] == readable:
                freed += 1
        return None, freed
    view = _view(pins)
    idx = np.asarray(slots, dtype=np.intp)
    uniq, counts = np.unique(idx, return_counts=True)
    left = view[uniq] - counts
    if (left < 0).any():
        short = uniq[left < 0]
        return int(np.flatnonzero(np.isin(idx, short))[0]), 0
    view[uniq] = left
    free = left == 0
    free &= np.frombuffer(state, dtype=np.uint8)[uniq] == readable
    return None, int(np.count_nonzero(free))


def set_states(state: bytearray, slots: Sequence[int], value: int) -> None:
    """``state[s] = value`` for each of ``slots``."""
    if len(slots) < SMALL:
        for s in slots:
            state[s] = value
    else:
        np.frombuffer(state, dtype=np.uint8)[np.asarray(slots, dtype=np.intp)] = value
