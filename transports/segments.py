"""Shared-memory segment names that say who owns them, and the sweep of those whose owner is
gone (a SIGKILLed server leaves its segments in /dev/shm)::

    tkv-<pid>-<start time>-<random>         transports.shm's allocate()
    tkv-host-<pid>-<start time>-<random>    a page server's host arena (remote.server.hosting)

The start time (clock ticks since boot, /proc/<pid>/stat field 22) tells a live owner from
another process that reused its pid.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterable

__all__ = ["remove_stale_segments", "segment_name"]

_OWNED = re.compile(r"tkv-(?:[a-z]+-)?(\d+)-(\d+)-[0-9a-f]+")


def _start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    return int(fields[19])  # field 22 of stat(5); fields[0] is field 3


def segment_name(prefix: str = "tkv") -> str:
    """A fresh segment name carrying our pid and start time: ``<prefix>-<pid>-<start>-<hex>``
    (``prefix`` is ``tkv`` or ``tkv-<word>``)."""
    pid = os.getpid()
    return f"{prefix}-{pid}-{_start_time(pid) or 0}-{secrets.token_hex(6)}"


def remove_stale_segments(folder: str = "/dev/shm") -> list[str]:
    """Unlink our uid's tierkv segments whose owner process is gone (or is another process
    with the same pid); returns their names."""
    removed = []
    uid = os.getuid()
    for name in _listdir(folder):
        m = _OWNED.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(folder, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
        except OSError:
            continue
        pid, start = int(m.group(1)), int(m.group(2))
        if _start_time(pid) == start:
            continue  # alive
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(name)
    return removed


def _listdir(folder: str) -> Iterable[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []
