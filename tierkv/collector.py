"""The cyclic garbage collector in a long-running server: one call after warm-up.

CPython's cyclic collector stops the whole process for a pass, inside whichever callback happens
to allocate when one is due; a full (generation 2) pass visits every tracked container alive.
After ``import torch`` and a model load that is ~170,000 objects, and one full pass costs
~40-100 ms on the machines here: an event loop that serves tokens every few ms must not pay
that in the middle of a step.

tierkv keeps its own per-sequence and per-page bookkeeping out of the collector's way (flat
arrays and untracked dicts of bytes -> int; see ``benchmarks/loop_scale.py`` for the figures), so
a server that never calls this still meets the loop targets. What is left is the rest of the
process: the model, the framework, the server. Call :func:`settle_collector` once warm-up is
done (model loaded, store open, a first request served)::

    import tierkv

    previous = tierkv.settle_collector()      # collect, freeze the survivors, raise gen-0's bar
    ...                                       # serve
    tierkv.restore_collector(previous)        # optional: back to what it was

It does what vLLM and other servers do after start-up:

1. ``gc.collect()`` - drop what warm-up left behind;
2. ``gc.freeze()`` - move every survivor into the permanent generation, which later passes skip
   (a full pass then costs only what was allocated since);
3. ``gc.set_threshold(gen0, gen1, gen2)`` - fewer young passes (the default 700 allocations
   between gen-0 passes suits scripts, not servers that allocate a few objects per token).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from tierkv.errors import InvalidInputError, InvalidTypeError

__all__ = ["CollectorSettings", "restore_collector", "settle_collector"]

SERVER_THRESHOLDS = (10_000, 20, 20)
"""Generation thresholds :func:`settle_collector` sets by default."""


@dataclass(frozen=True)
class CollectorSettings:
    """The collector's settings before :func:`settle_collector` changed them."""

    thresholds: tuple[int, int, int]
    enabled: bool
    frozen_before: int  # objects already in the permanent generation
    frozen_now: int  # objects this call moved there


def settle_collector(
    thresholds: tuple[int, int, int] = SERVER_THRESHOLDS,
) -> CollectorSettings:
    """Collect, freeze the survivors into the permanent generation, set ``thresholds``.

    Call once after warm-up, from the thread that runs the event loop (nothing else should be
    allocating heavily at that moment). Returns the previous settings for
    :func:`restore_collector`.

    Raises:
        InvalidInputError: not three positive ints (a ValueError); nothing is changed then.
    """
    if (
        not isinstance(thresholds, tuple | list)
        or len(thresholds) != 3
        or any(not isinstance(t, int) or isinstance(t, bool) or t <= 0 for t in thresholds)
    ):
        raise InvalidInputError(f"thresholds must be three positive ints, got {thresholds!r}")
    t0, t1, t2 = gc.get_threshold()
    before = gc.get_freeze_count()
    enabled = gc.isenabled()
    gc.collect()
    gc.freeze()
    gc.set_threshold(*thresholds)
    gc.enable()
    return CollectorSettings((t0, t1, t2), enabled, before, gc.get_freeze_count() - before)


def restore_collector(previous: CollectorSettings) -> None:
    """Undo :func:`settle_collector`: thresholds and enabled state back, frozen objects back
    into the collected generations (all of them: ``gc.unfreeze`` cannot tell whose they were).
    Raises InvalidTypeError for anything but settle_collector's result (before any change)."""
    if not isinstance(previous, CollectorSettings):  # (a str was an AttributeError)
        raise InvalidTypeError(
            f"restore_collector takes settle_collector's result, got {type(previous).__name__}"
        )
    gc.set_threshold(*previous.thresholds)
    gc.unfreeze()
    if previous.enabled:
        gc.enable()
    else:
        gc.disable()
