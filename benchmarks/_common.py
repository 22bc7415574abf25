"""Shared helpers for the benchmark scripts: argument parsing, tables, the JSON result file,
and the ``--trace FILE`` Chrome trace (Perfetto).

Tracing a benchmark::

    args = parser(__doc__).parse_args()          # --quick, --json FILE, --trace FILE
    start_trace(args.trace)                      # records only when --trace was given
    with phase("replay lru", blocks=6000):       # a span on the "benchmark" track
        ...
    write_trace(args.trace, ("store", store.timeline))   # phases + any runtime timelines

Each part (the phases, each store's or engine's timeline) becomes a process of its own in the
file; all share one clock.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tierkv import timeline
from tierkv.timeline import Timeline, merge

PHASES = Timeline()  # the measured phases of this benchmark run


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the conventional ``--quick``, ``--json FILE`` and
    ``--trace FILE`` flags."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run (smaller sizes)")
    p.add_argument("--json", metavar="FILE", help="write figures and ratios as JSON")
    add_trace_flag(p)
    return p


def add_trace_flag(p: argparse.ArgumentParser) -> None:
    """Add ``--trace FILE`` (for a benchmark with a parser of its own)."""
    p.add_argument(
        "--trace",
        metavar="FILE.json",
        help="write a Chrome trace of the run (open it in https://ui.perfetto.dev); "
        "recording adds a little overhead to the figures",
    )


def start_trace(path: str | None) -> Timeline:
    """Start recording :data:`PHASES` when ``path`` is given; returns it."""
    PHASES.enabled = bool(path)
    return PHASES


@contextmanager
def phase(name: str, **args: Any) -> Iterator[None]:
    """A span named ``name`` on the ``benchmark`` track around the block (when tracing)."""
    with PHASES.measure(name, "benchmark", **args):
        yield


def span(name: str, start: float, end: float, **args: Any) -> None:
    """Record an already timed ``[start, end)`` (perf_counter seconds) on the ``benchmark``
    track (when tracing): for timed loops that must not pay for a context manager."""
    PHASES.span(name, "benchmark", start, end, **args)


def write_trace(path: str | None, *parts: tuple[str, Timeline | dict[str, Any]]) -> None:
    """Write the phases and ``parts`` (``(label, Timeline or to_chrome() document)``) to
    ``path`` as one Chrome trace, each part a process of its own. Nothing without a path."""
    if not path:
        return
    docs: list[tuple[str, dict[str, Any]]] = []
    if len(PHASES):
        docs.append(("benchmark phases", PHASES.to_chrome()))
    for label, part in parts:
        docs.append((label, part.to_chrome() if isinstance(part, Timeline) else part))
    doc = merge(docs)
    timeline.write_json(path, doc)
    n = sum(1 for e in doc["traceEvents"] if e["ph"] != "M")
    dropped = doc["otherData"]["dropped_events"]
    print(f"wrote {path} ({n} trace events, {dropped} dropped; open it in https://ui.perfetto.dev)")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table."""
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def write_json(path: str | None, figures: dict[str, Any], ratios: dict[str, Any]) -> None:
    """Write ``{"figures": ..., "ratios": ..., "machine": ...}`` to ``path`` (if given)."""
    if not path:
        return
    doc = {
        "figures": figures,
        "ratios": ratios,
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    print(f"wrote {path}")
