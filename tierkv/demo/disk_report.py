"""The disk tier as ``tierkv demo --disk`` and ``tierkv replay --disk`` show it: figures from a
disk tier's statistics (``KVStore.stats()["disk"]``, or a ``DiskStats``) and the table rows
both print. Imports nothing of theirs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["disk_figures", "disk_rows"]

_KEYS = (
    "hits",
    "misses",
    "corrupt_pages",
    "damaged_at_open",
    "read_errors",
    "pages_written",
    "write_failures",
    "no_room",
    "bytes_read",
    "bytes_written",
    "recovered",
    "used",
    "capacity",
    "io_mode",
    "io_mode_reason",
)


def disk_figures(d: Mapping[str, Any] | Any) -> dict[str, Any]:
    """The figures a report keeps of a disk tier's statistics: a mapping (the store's
    ``stats()["disk"]``, whose chain counters ``imported`` / ``import_missed`` / ``stored`` /
    ``write_failed`` come along when present) or a ``DiskStats``."""
    get = d.get if isinstance(d, Mapping) else lambda k, default=None: getattr(d, k, default)
    out = {k: get(k) for k in _KEYS}
    for k in ("imported", "import_missed", "stored", "write_failed", "path"):
        if get(k) is not None:
            out[k] = get(k)
    return out


def disk_rows(f: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Table rows of :func:`disk_figures`: I/O mode (and why buffered), pages read and written
    with their bytes, corrupt pages, pages found at open."""
    mb = 1 / (1 << 20)
    mode = f["io_mode"]
    if mode != "direct" and f.get("io_mode_reason"):
        mode += f" ({f['io_mode_reason']})"
    where = f" {f['path']}" if f.get("path") else ""
    damaged = f["damaged_at_open"] + f["read_errors"]
    corrupt = f"{f['corrupt_pages']}"
    if damaged:
        corrupt += f"; {damaged} damaged at open or unreadable"
    return [
        (f"disk tier{where}", f"I/O {mode}; {f['used']} of {f['capacity']} slots used"),
        (
            "disk hits (pages read, verified)",
            f"{f['hits']} ({f['bytes_read'] * mb:.1f} MiB), {f['misses']} misses",
        ),
        (
            "disk pages written",
            f"{f['pages_written']} ({f['bytes_written'] * mb:.1f} MiB), "
            f"{f['write_failures']} failed, {f['no_room']} refused for room",
        ),
        ("disk corrupt pages (counted misses)", corrupt),
        ("disk pages found at open", f"{f['recovered']} (left by an earlier store on the path)"),
    ]
