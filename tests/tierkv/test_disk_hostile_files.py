"""A disk path whose files were damaged or planted between runs (docs/disk.md): a layout.json
of hostile JSON is a DiskLayoutError (never OverflowError or RecursionError), and a lock or
segment that is a symbolic link is refused with the file it points at left as it was (the
open truncates, preallocates and writes both)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tierkv.disk import DiskConfigError, DiskForeignDirError, DiskLayoutError

sys.path.insert(0, str(Path(__file__).parent))
from disk_util import key, open_disk, write_sync


@pytest.mark.parametrize(
    "layout",
    [
        '{"format": Infinity, "page_bytes": 1, "key_bytes": 32, "slot_bytes": 1, '
        '"slots_per_segment": 1}',
        '{"format": 1e400, "page_bytes": 1, "key_bytes": 32, "slot_bytes": 1, '
        '"slots_per_segment": 1}',
        "[" * 3000,  # nesting past the recursion limit
        '{"format": 1.0, "page_bytes": 4096.5, "key_bytes": 32, "slot_bytes": 8192, '
        '"slots_per_segment": 8}',  # floats were truncated to ints
        '{"format": true, "page_bytes": 1, "key_bytes": 32, "slot_bytes": 1, '
        '"slots_per_segment": 1}',
        "[1, 2]",
        "null",
    ],
    ids=["infinity", "1e400", "nested", "floats", "bool", "list", "null"],
)
def test_a_hostile_layout_file_is_a_layout_error(tmp_path: Path, layout: str) -> None:
    with open_disk(tmp_path) as disk:
        write_sync(disk, [key(0)])
    (tmp_path / "layout.json").write_text(layout)
    with pytest.raises(DiskLayoutError, match="not a tierkv disk layout"):
        open_disk(tmp_path)
    assert (tmp_path / "layout.json").read_text() == layout  # kept for its owner to look at


@pytest.mark.parametrize("name", ["lock", "segment-00000.tkvd"])
def test_a_planted_link_is_refused_and_its_target_untouched(tmp_path: Path, name: str) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    disk_dir = tmp_path / "kv"
    disk_dir.mkdir()
    (disk_dir / name).symlink_to(victim)
    with pytest.raises(DiskConfigError):
        open_disk(disk_dir)
    assert victim.read_bytes() == b"precious"
    assert (disk_dir / name).is_symlink()


def test_a_users_file_named_lock_is_refused_untouched(tmp_path: Path) -> None:
    """A mistyped disk path (a user's folder that holds a file named ``lock``): the old open
    truncated that file and wrote its pid into it before anything else. Now a lock file that
    is not a disk tier's (empty, or a pid and a newline) is a DiskLayoutError, the file as it
    was and nothing created beside it; a lock a disk tier left is taken over as before."""
    (tmp_path / "lock").write_bytes(b"my notes\n" * 10)
    (tmp_path / "other").write_bytes(b"x")
    with pytest.raises(DiskLayoutError, match="not a tierkv disk lock"):
        open_disk(tmp_path)
    assert (tmp_path / "lock").read_bytes() == b"my notes\n" * 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock", "other"]
    ours = tmp_path / "ours"
    ours.mkdir()
    with open_disk(ours) as disk:
        write_sync(disk, [key(0)])
    assert (ours / "lock").read_bytes().rstrip(b"\n").isdigit()
    with open_disk(ours):  # its own lock, left by the last close: taken over
        pass
    (ours / "lock").write_bytes(b"")
    with open_disk(ours):  # empty (a process died between create and write): taken over
        pass


def test_a_foreign_folder_is_refused_untouched(tmp_path: Path) -> None:
    """A disk path that is someone's non-empty folder (no disk tier's lock or layout there):
    the old open added a lock, a layout and preallocated segments beside the user's files. Now
    it is a DiskForeignDirError naming them, nothing created; ``overwrite=True`` takes the
    folder over (the user's files kept), and an empty folder or a ``lost+found`` is ours."""
    (tmp_path / "notes.txt").write_bytes(b"mine")
    (tmp_path / "photos").mkdir()
    with pytest.raises(DiskForeignDirError, match=r"notes\.txt") as info:
        open_disk(tmp_path)
    assert isinstance(info.value, DiskConfigError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "photos"]
    with pytest.raises(DiskConfigError, match="overwrite must be a bool"):
        open_disk(tmp_path, overwrite="yes")
    with open_disk(tmp_path, overwrite=True) as disk:
        write_sync(disk, [key(0)])
    assert (tmp_path / "notes.txt").read_bytes() == b"mine"
    with open_disk(tmp_path) as disk:  # its lock and layout now: ours, reopened as before
        assert disk.lookup([key(0)]) != [None]
    mount = tmp_path / "mount"
    mount.mkdir()
    (mount / "lost+found").mkdir()
    with open_disk(mount):
        pass


@pytest.mark.parametrize("threads", [0, 1025, 100_000, True, 2.0])
def test_io_threads_are_bounded(tmp_path: Path, threads: object) -> None:
    """io_threads of 100,000 mapped a scratch buffer each until mmap failed: an OSError
    (ENOMEM), untyped. Now a DiskConfigError before anything is created."""
    with pytest.raises(DiskConfigError, match="io_threads"):
        open_disk(tmp_path, io_threads=threads)
    assert list(tmp_path.iterdir()) == []
