"""How the demos time their passes: a warm-up pass of every kind first, then ``repeat``
rounds in which the kinds alternate (the order rotates each round), and the median per kind.

On a shared machine a single pass's speed swings with whatever else runs; a ratio of two
passes that ran minutes apart swings twice as much. Alternating the kinds exposes them to the
same load, and the median drops the round a neighbour's burst hit::

    warm-up  R T I                         (short, not counted)
    round 1  R T I   round 2  T I R   round 3  I R T
    figure   median over rounds k of T_k / R_k (a round's passes share the load of the moment)

Each pass is timed twice: wall clock (tokens/s, what a user waits for) and the process's CPU
time (all its threads). On a machine that others load, the scheduler shares the cores per
thread, so a pass whose store works in a second thread gets a bigger share the busier the
machine is: the wall ratio then drifts with the load, while tokens per CPU-second measure the
work each pass does, whatever the load.

The collector stays out of timed passes (:func:`no_gc`): the tiered passes allocate more small
objects (tasks, futures), so a full collection of the model's and transformers' objects landed
in them more often than in the reference passes, at random steps.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from tierkv.errors import InvalidInputError


def order(kinds: Sequence[str], round_index: int) -> list[str]:
    """The kinds of round ``round_index``, rotated so that each kind leads a round in turn."""
    k = round_index % len(kinds) if kinds else 0
    return [*kinds[k:], *kinds[:k]]


@contextmanager
def no_gc() -> Iterator[None]:
    """Collect now, then keep the garbage collector off for the block (restored after)."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Clock:
    """Wall and process CPU seconds of a block: ``with Clock() as c: ...``, then ``c.wall``,
    ``c.cpu``."""

    wall = cpu = 0.0

    def __enter__(self) -> Clock:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._wall
        self.cpu = time.process_time() - self._cpu


def _ratios(tokens: int, ref_s: list[float], got_s: list[float]) -> dict[str, Any]:
    per_round = [r / g for g, r in zip(got_s, ref_s)]  # (n / g) / (n / r)
    return {
        "tiered": statistics.median(tokens / s for s in got_s),
        "reference": statistics.median(tokens / s for s in ref_s),
        "ratio": statistics.median(per_round),
        "per_round": per_round,
    }


def speed_figures(
    tokens: int,
    reference: Sequence[tuple[float, float]],
    tiered: Sequence[tuple[float, float]],
) -> dict[str, Any]:
    """Median tokens/s (wall) and tokens per CPU-second of each kind over the rounds, and the
    median of the per-round ratios tiered / reference (a round's passes ran side by side, so a
    slow drift of the machine's load cancels in its ratio). ``reference`` and ``tiered``:
    (wall, cpu) seconds per round. Raises ValueError for no rounds or unequal counts.
    """
    if not reference or len(reference) != len(tiered):
        raise InvalidInputError("speed_figures: one reference and one tiered time per round")
    wall = _ratios(tokens, [w for w, _ in reference], [w for w, _ in tiered])
    cpu = _ratios(tokens, [max(c, 1e-9) for _, c in reference], [max(c, 1e-9) for _, c in tiered])
    return {
        "tokens_per_s": wall["tiered"],
        "all_resident_tokens_per_s": wall["reference"],
        "speed_of_all_resident": wall["ratio"],
        "speed_per_round": wall["per_round"],
        "tokens_per_cpu_s": cpu["tiered"],
        "all_resident_tokens_per_cpu_s": cpu["reference"],
        "cpu_speed_of_all_resident": cpu["ratio"],
        "cpu_speed_per_round": cpu["per_round"],
        "rounds": len(reference),
        "seconds_per_round": {"reference": list(reference), "tiered": list(tiered)},
    }


def speed_rows(r: dict[str, Any], note: str = "") -> list[tuple[str, str]]:
    """The table rows of :func:`speed_figures`'s figures."""

    def spread(key: str) -> str:
        rounds = r[key]
        if len(rounds) == 1:
            return "1 round"
        return f"median of {len(rounds)} rounds; {min(rounds):.3f}-{max(rounds):.3f}"

    return [
        (
            "tokens/s vs all-resident",
            f"{r['tokens_per_s']:.1f} / {r['all_resident_tokens_per_s']:.1f}: "
            f"{r['speed_of_all_resident']:.3f} ({spread('speed_per_round')}){note}",
        ),
        (
            "tokens/CPU-s vs all-resident",
            f"{r['tokens_per_cpu_s']:.1f} / {r['all_resident_tokens_per_cpu_s']:.1f}: "
            f"{r['cpu_speed_of_all_resident']:.3f} ({spread('cpu_speed_per_round')})",
        ),
    ]
