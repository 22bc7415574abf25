"""Shared helpers for the benchmark scripts: argument parsing, tables, the JSON result file."""

from __future__ import annotations

import argparse
import json
import platform
import sys
from typing import Any


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the conventional ``--quick`` and ``--json FILE`` flags."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a short run (smaller sizes)")
    p.add_argument("--json", metavar="FILE", help="write figures and ratios as JSON")
    return p


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
