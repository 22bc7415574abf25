"""Opening PATH: validate, lock, create or check the segments, pick the I/O mode, scan headers.

Everything an open creates is removed again if the open fails (the lock file only while this
process holds the lock, so that a concurrent opener never loses its lock file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
from dataclasses import dataclass, field

from .errors import (
    DiskConfigError,
    DiskForeignDirError,
    DiskInUseError,
    DiskLayoutError,
    DiskSpaceError,
)
from .io import choose_mode
from .layout import (
    LAYOUT_FILE,
    LOCK_FILE,
    Geometry,
    check_layout,
    read_layout,
    segment_name,
    write_layout,
)

_OPEN = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
"""Every file of PATH is opened as itself, never through a symbolic link: the lock and the
segments are truncated, preallocated and written (a link would aim that at another file)."""

_SEGMENT = re.compile(r"segment-(\d{5,})\.tkvd")
_OUR_NAMES = re.compile(r"lock|layout\.json(\.tmp)?|segment-\d{5,}\.tkvd|lost\+found")
"""Names a disk path may hold before a disk tier first opens it (``lost+found``: the root of a
freshly made filesystem, a common mount point)."""


@dataclass(slots=True)
class Opened:
    """The files of an open PATH (closed by `release`)."""

    path: str
    lock_fd: int = -1
    fds: list[int] = field(default_factory=list)
    mode_reason: str = ""  # "" when O_DIRECT is in use
    created: list[str] = field(default_factory=list)
    locked: bool = False

    def release(self, *, remove_created: bool) -> None:
        """Close the segment files and the lock; remove what this open created if asked."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []
        if remove_created and self.locked:
            for name in reversed(self.created):
                with contextlib.suppress(OSError):
                    os.unlink(name)
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # closing the last descriptor drops the flock
            self.lock_fd = -1


def open_files(path: str, geometry: Geometry, direct: bool, overwrite: bool = False) -> Opened:
    """Lock PATH and open its segments (created and preallocated when missing). Raises
    DiskConfigError (missing or read-only directory, another layout), DiskForeignDirError (a
    non-empty directory no disk tier made, unless ``overwrite``), DiskInUseError,
    DiskSpaceError; nothing created is left behind then."""
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is not a directory"
        raise DiskConfigError(f"disk path {path!r} {what}; create the directory first")
    if not overwrite:
        _check_ours(path)
    opened = Opened(path)
    try:
        _lock(opened)
        recorded = read_layout(path)
        if recorded is not None:
            check_layout(path, recorded, geometry)
        _check_space(path, geometry)
        for seg in range(geometry.segments):
            opened.fds.append(_segment(opened, geometry, seg))
        first = os.path.join(path, segment_name(0))
        opened.mode_reason = choose_mode(path, first, direct)
        if not opened.mode_reason:
            _reopen_direct(opened, geometry)
        if recorded is None:
            write_layout(path, geometry)
            opened.created.append(os.path.join(path, "layout.json"))
    except BaseException:
        opened.release(remove_created=True)
        raise
    _drop_segments_beyond(path, geometry.segments)
    return opened


def _check_ours(path: str) -> None:
    """DiskForeignDirError when PATH holds files of other names than a disk tier's and neither
    its lock nor its layout file (a mistyped path: a user's folder, a home directory): the
    open would add a lock, a layout and gigabytes of preallocated segments beside them."""
    if os.path.lexists(os.path.join(path, LOCK_FILE)) or os.path.lexists(
        os.path.join(path, LAYOUT_FILE)
    ):
        return  # a disk tier's (its own checks follow)
    try:
        with os.scandir(path) as entries:
            foreign = [e.name for e in entries if not _OUR_NAMES.fullmatch(e.name)]
    except OSError as exc:
        raise DiskConfigError(f"cannot list disk path {path!r}: {exc.strerror}") from exc
    if foreign:
        shown = ", ".join(repr(n) for n in sorted(foreign)[:3])
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise DiskForeignDirError(
            f"disk path {path!r} holds files that are not a disk tier's ({shown}{more}) and no "
            "tierkv lock or layout: left untouched; give an empty directory or one a disk tier "
            "made, or overwrite=True to take this one over (its files are kept)"
        )


def _drop_segments_beyond(path: str, count: int) -> None:
    # The capacity shrank since the last open: what the old segments held no longer counts.
    seg = count
    while os.path.exists(name := os.path.join(path, segment_name(seg))):
        os.unlink(name)
        seg += 1


def _lock(opened: Opened) -> None:
    name = os.path.join(opened.path, LOCK_FILE)
    existed = os.path.exists(name)
    try:
        opened.lock_fd = os.open(name, _OPEN | os.O_CREAT, 0o644)
    except OSError as exc:
        raise DiskConfigError(
            f"cannot create files in disk path {opened.path!r}: {exc.strerror} "
            "(a read-only directory or filesystem?)"
        ) from exc
    if not existed:
        opened.created.append(name)
    elif not _ours(opened.lock_fd):
        os.close(opened.lock_fd)
        opened.lock_fd = -1
        raise DiskLayoutError(
            f"{name} is not a tierkv disk lock (ours holds a pid): left untouched; a disk path "
            "is a directory of the disk tier's own, give another one"
        )
    try:
        fcntl.flock(opened.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise DiskConfigError(f"cannot lock {name}: {exc.strerror}") from exc
        holder = os.pread(opened.lock_fd, 32, 0).decode("ascii", "replace").strip() or "?"
        raise DiskInUseError(
            f"disk path {opened.path!r} is in use (locked by pid {holder}); one process at a "
            "time may open it: give each process its own path"
        ) from exc
    opened.locked = True
    os.ftruncate(opened.lock_fd, 0)
    os.pwrite(opened.lock_fd, f"{os.getpid()}\n".encode(), 0)


def _ours(lock_fd: int) -> bool:
    """Whether an existing lock file is one a disk tier wrote: empty, or a pid and a newline
    (read only: a user's file named ``lock`` in a mistyped path is not truncated)."""
    try:
        head = os.pread(lock_fd, 64, 0)
    except OSError:
        return False
    return re.fullmatch(rb"(\d{1,20}\n)?", head) is not None


def _check_space(path: str, geometry: Geometry) -> None:
    """DiskSpaceError, before any segment is created or grown, when the segments need more
    bytes than the filesystem has free (a ``disk_bytes=1 << 50`` typo preallocated segments
    until the disk was full, then removed them: seconds of a full disk for everyone)."""
    need = geometry.capacity * geometry.slot_bytes
    try:
        with os.scandir(path) as entries:  # the segments there already count what they hold
            for e in entries:
                m = _SEGMENT.fullmatch(e.name)
                if m is not None and int(m[1]) < geometry.segments:
                    want = geometry.segment_slots(int(m[1])) * geometry.slot_bytes
                    need -= min(want, e.stat().st_size)
        st = os.statvfs(path)
    except OSError:
        return  # (cannot tell: the preallocation says)
    free = st.f_bavail * st.f_frsize
    if need > free:
        raise DiskSpaceError(
            f"disk path {path!r}: the disk tier needs {need} more bytes "
            f"({geometry.capacity} slots of {geometry.slot_bytes} bytes), the filesystem has "
            f"{free} free; nothing was created"
        )


def _segment(opened: Opened, geometry: Geometry, seg: int) -> int:
    name = os.path.join(opened.path, segment_name(seg))
    want = geometry.segment_slots(seg) * geometry.slot_bytes
    existed = os.path.exists(name)
    try:
        fd = os.open(name, _OPEN | os.O_CREAT, 0o644)
    except OSError as exc:
        raise DiskConfigError(f"cannot open segment {name}: {exc.strerror}") from exc
    if not existed:
        opened.created.append(name)
    try:
        size = os.fstat(fd).st_size
        if size > want:
            os.ftruncate(fd, want)  # the capacity shrank since the last open
        elif size < want:
            os.posix_fallocate(fd, 0, want)
    except OSError as exc:
        os.close(fd)
        raise DiskSpaceError(
            f"cannot preallocate {want} bytes for {name}: {exc.strerror} "
            f"({geometry.capacity} slots of {geometry.slot_bytes} bytes asked in all)"
        ) from exc
    return fd


def _reopen_direct(opened: Opened, geometry: Geometry) -> None:
    for seg, fd in enumerate(opened.fds):
        name = os.path.join(opened.path, segment_name(seg))
        opened.fds[seg] = os.open(name, _OPEN | os.O_DIRECT)
        os.close(fd)
