"""A disk tier larger than the filesystem's free space is refused before anything is created
(tierkv/disk/open.py): a ``disk_bytes=1 << 50`` typo preallocated segments until the disk was
full (80 GB here in 2.2 s), then removed them. Reopening a tier whose segments exist needs no
free space."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

import tierkv.disk.open as disk_open
from tierkv.disk import DiskPages, DiskSpaceError

sys.path.insert(0, str(Path(__file__).parent))
from disk_util import PAGE, key, open_disk, write_sync

_STATVFS = os.statvfs


class _Fs:
    """``os.statvfs`` of a filesystem with ``free`` bytes available."""

    def __init__(self, free: int) -> None:
        self.free = free

    def __call__(self, path: Any) -> Any:
        real = _STATVFS(path)
        return os.statvfs_result((*real[:4], self.free // real.f_frsize, *real[5:]))


def test_a_tier_over_the_free_space_is_refused_before_anything_is_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fails on the old code: it opened (preallocating) whatever the free space."""
    grown: list[int] = []
    fallocate = os.posix_fallocate
    monkeypatch.setattr(disk_open.os, "statvfs", _Fs(64 << 10))
    monkeypatch.setattr(
        disk_open.os, "posix_fallocate", lambda fd, o, n: (grown.append(n), fallocate(fd, o, n))
    )
    with pytest.raises(DiskSpaceError, match="filesystem has 65536 free; nothing was created"):
        DiskPages.open(tmp_path, page_bytes=PAGE, disk_bytes=1 << 20)
    assert grown == [] and os.listdir(tmp_path) == []


def test_reopening_a_tier_needs_no_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_disk(tmp_path, slots=8) as disk:
        write_sync(disk, [key(1)])
        size = disk.geometry.capacity * disk.geometry.slot_bytes
    monkeypatch.setattr(disk_open.os, "statvfs", _Fs(0))  # full now: the segments are there
    with open_disk(tmp_path, slots=8) as again:
        assert again.lookup([key(1)]) == [0]
    with pytest.raises(DiskSpaceError, match=f"needs {size} more bytes"):
        open_disk(tmp_path, slots=16)  # growing it needs the new half
