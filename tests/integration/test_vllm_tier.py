"""tierkv's tiers inside vLLM 0.33's own tiering manager, on the CPU (issue 27).

vLLM's `TieringOffloadingManager` is built by vLLM's spec and tier factory from tier configs
(`vllm_driver.build`) and driven as its scheduler would; every chunk loaded is checked byte for
byte in the primary tier's memory. The same script runs on vLLM's shipped ``fs`` tier as the
reference: vLLM must answer the same for both. Skipped where vLLM is not installed.
"""

from __future__ import annotations

import glob
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "vllm.v1.kv_offload.tiering.manager",
    reason="vLLM 0.33 not installed (pip install --no-deps vllm==0.33.0: docs/vllm.md)",
)

sys.path.insert(0, str(Path(__file__).parent))
from vllm_driver import TIERKV, Script, build, key, run_sequence, store_in_a_child

from tierkv.disk import DiskConfigError, DiskError, DiskForeignDirError, DiskInUseError
from tierkv.integrations.vllm import (
    TierKVDiskTier,
    VllmTierConfigError,
    VllmTierTypeError,
)


def disk_tier(where: Path, **kw: Any) -> dict[str, Any]:
    return {"type": "TierKVDiskTier", "module_path": TIERKV, "path": str(where),
            "disk_bytes": 64 << 20, "io_threads": 2, **kw}  # fmt: skip


def fs_tier(path: Path) -> dict[str, Any]:
    return {"type": "fs", "root_dir": str(path), "n_read_threads": 2, "n_write_threads": 2}


def run(tiers: list[dict[str, Any]], **kw: Any) -> Script:
    s = Script(build(tiers, **kw))
    try:
        run_sequence(s)
    finally:
        s.close()
    return s


def test_disk_tier_answers_as_vllms_fs_tier_bit_exact(tmp_path: Path) -> None:
    (tmp_path / "fs").mkdir()
    (tmp_path / "disk").mkdir()
    reference = run([fs_tier(tmp_path / "fs")])
    ours = Script(build([disk_tier(tmp_path / "disk")]))
    try:
        run_sequence(ours)
        stats = ours.manager.secondary_tiers[0].tierkv_stats()
    finally:
        ours.close()
    assert ours.log == reference.log
    assert reference.mismatches == ours.mismatches == 0
    assert stats["disk_pages_written"] == 24  # every chunk went to disk once
    assert stats["disk_hits"] >= 24  # and the primary's misses came back from it
    assert stats["disk_corrupt_pages"] == 0
    assert stats["jobs_failed"] == 0 and stats["jobs_done"] >= 6 + 24  # 6 stores, the loads


def test_both_tiers_at_once(tmp_path: Path) -> None:
    """tierkv's disk tier beside vLLM's fs tier in one manager."""
    (tmp_path / "fs").mkdir()
    (tmp_path / "disk").mkdir()
    s = run([disk_tier(tmp_path / "disk"), fs_tier(tmp_path / "fs")])
    assert s.mismatches == 0
    assert ("lookup", ["HIT"] * 12) in s.log


def test_a_restart_finds_the_chunks_and_another_model_does_not(tmp_path: Path) -> None:
    """Pages outlive the process (content keys); the model and the layout are in the key."""
    s = Script(build([disk_tier(tmp_path)]))
    keys = [key(i) for i in range(12)]
    try:
        for lo in range(0, 12, 4):
            s.store(f"w{lo}", keys[lo : lo + 4])
            s.settle()
            s.end(f"w{lo}")
        s.settle()
    finally:
        s.close()
    again = Script(build([disk_tier(tmp_path)]))
    try:
        assert again.lookup("r", keys) == ["HIT"] * 12
        assert again.mismatches == 0
    finally:
        again.close()
    for other in ({"model": "org/model-b"}, {"dtype": "bfloat16"}, {"blocks_per_chunk": 4,
                  "block_bytes": 128 << 10}):  # fmt: skip
        s2 = Script(build([disk_tier(tmp_path, disk_bytes=64 << 20)], **other))
        try:
            assert s2.lookup("r", keys[:4]) == ["MISS"] * 4, other
        finally:
            s2.close()


def test_one_process_per_disk_path(tmp_path: Path) -> None:
    s = Script(build([disk_tier(tmp_path)]))
    try:
        with pytest.raises(DiskInUseError):
            build([disk_tier(tmp_path)])
    finally:
        s.close()


@pytest.mark.parametrize(
    ("fields", "error", "words"),
    [
        ({"colour": "blue"}, VllmTierConfigError, "unknown config field"),
        ({"disk_bytes": "64MB"}, VllmTierTypeError, "disk_bytes"),
        ({"direct": 1}, VllmTierTypeError, "direct"),
        ({"io_threads": True}, VllmTierTypeError, "io_threads"),
        ({"io_threads": 0}, VllmTierConfigError, "io_threads"),
        ({"io_threads": 10**5}, DiskConfigError, "io_threads"),  # was an OSError (ENOMEM)
        ({"overwrite": "yes"}, VllmTierTypeError, "overwrite"),
        ({"path": None}, VllmTierTypeError, "path"),
        ({"locality": "upstairs"}, VllmTierConfigError, "locality"),
    ],
)
def test_a_bad_config_is_a_typed_error_at_startup(
    tmp_path: Path, fields: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        build([disk_tier(tmp_path, **fields)])
    assert list(tmp_path.iterdir()) == []  # nothing created
    assert issubclass(error, ValueError)


def test_a_foreign_folder_is_refused_unless_overwrite(tmp_path: Path) -> None:
    """vLLM's disk tier pointed at someone's folder: DiskForeignDirError, nothing created
    beside the user's file; ``"overwrite": true`` takes it over."""
    (tmp_path / "notes.txt").write_bytes(b"mine")
    with pytest.raises(DiskForeignDirError):
        build([disk_tier(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    s = Script(build([disk_tier(tmp_path, overwrite=True)]))
    s.close()
    assert (tmp_path / "notes.txt").read_bytes() == b"mine"


@pytest.mark.parametrize("why", ["no such directory", "in use"])
def test_a_failed_startup_leaves_vllms_region_unmapped(tmp_path: Path, why: str) -> None:
    """A tier that fails after seeing the primary's view must drop it: vLLM then unmaps and
    removes its shared region (it keeps a region whose buffers are still exported)."""
    engine = f"tierkv-failed-start-{os.getpid()}"
    holder = Script(build([disk_tier(tmp_path)])) if why == "in use" else None
    where = tmp_path / "nowhere" if why == "no such directory" else tmp_path
    try:
        with pytest.raises(DiskError):
            build([disk_tier(where)], engine=engine)
    finally:
        if holder is not None:
            holder.close()
    assert glob.glob(f"/dev/shm/vllm_offload_{engine}*") == []


def test_a_missing_field_is_a_typed_error(tmp_path: Path) -> None:
    config = disk_tier(tmp_path)
    del config["disk_bytes"]
    with pytest.raises(VllmTierConfigError, match="'disk_bytes' is required"):
        build([config])


class _Broken:
    """Stands in for DiskPages' I/O calls: the OS fails every write and read."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.exc


def test_a_failing_disk_gives_failed_stores_and_misses(tmp_path: Path) -> None:
    """ENOSPC raised by the disk's calls, then the disk closed under the tier: vLLM sees failed
    jobs and misses, never an exception; what was on disk before stays served."""
    s = Script(build([disk_tier(tmp_path)], cpu_chunks=4))
    tier = s.manager.secondary_tiers[0]
    assert isinstance(tier, TierKVDiskTier)
    keys = [key(i) for i in range(16)]
    try:
        s.store("a", keys[:4])
        s.settle()
        s.end("a")
        tier.disk.submit_write = _Broken(OSError(28, "No space left on device"))  # type: ignore[method-assign]
        for lo in range(4, 16, 4):
            s.store(f"w{lo}", keys[lo : lo + 4])
            s.settle()
            s.end(f"w{lo}")
        s.settle()
        # the first four were evicted from the 4-chunk primary: served from disk
        assert s.lookup("r", keys[:4]) == ["HIT"] * 4
        s.end("r")
        s.settle()
        del tier.disk.submit_write
        tier.disk.close()  # a disk gone under the tier: closed calls raise DiskClosedError
        assert s.lookup("r2", keys[4:8]) == ["MISS"] * 4
        s.store("b", [key(100 + i) for i in range(4)])
        s.settle()
        s.end("b")
        s.end("r2")
        s.settle()
        assert s.mismatches == 0
    finally:
        s.close()
    assert s.log.count(("stored", 4)) == 5


def test_disk_full_for_real_in_a_child(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (2 MiB) below the segments' size (4 MiB): the tier cannot open (a typed error at
    startup); with the segments in place and the limit then lowered, writes fail whole and
    become failed stores."""
    import subprocess
    import textwrap

    code = textwrap.dedent(
        f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from vllm_driver import Script, build, key, TIERKV
        from tierkv.disk import DiskSpaceError
        tier = {{"type": "TierKVDiskTier", "module_path": TIERKV, "path": {str(tmp_path)!r},
                "disk_bytes": 16 << 20, "segment_bytes": 4 << 20, "io_threads": 1}}
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
        try:
            build([tier], cpu_chunks=4)
        except DiskSpaceError as exc:
            print("startup:", type(exc).__name__)
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
        s = Script(build([tier], cpu_chunks=4))
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, resource.RLIM_INFINITY))
        keys = [key(i) for i in range(8)]
        for lo in range(0, 8, 4):
            s.store("w%d" % lo, keys[lo:lo + 4])
            s.settle()
            s.end("w%d" % lo)
        s.settle()
        st = s.manager.secondary_tiers[0].tierkv_stats()
        print("answers:", s.lookup("r", keys))
        print("written:", st["disk_pages_written"], "failures:", st["disk_write_failures"])
        s.end("r")
        s.close()
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "startup: DiskSpaceError" in lines
    answers = next(line for line in lines if line.startswith("answers:"))
    written = next(line for line in lines if line.startswith("written:"))
    # slots below 2 MiB (the limit; vLLM's own region is 2 MiB) are written; the rest fail
    n_written, n_failed = int(written.split()[1]), int(written.split()[3])
    assert n_failed > 0 and n_written + n_failed == 8
    # chunks still in the 4-chunk primary are hits; evicted ones are hits only if on disk
    assert answers.count("HIT") >= 4


def test_chunks_a_process_left_on_disk_are_hits_for_the_next(tmp_path: Path) -> None:
    """The disk path is one process's at a time (its lock): a vLLM instance in a child process
    stores a prefix and exits; an instance here opens the same path and loads it bit-exact."""
    store_in_a_child({"type": "TierKVDiskTier", "module_path": TIERKV,
                      "path": str(tmp_path), "disk_bytes": 64 << 20})  # fmt: skip
    s = Script(build([disk_tier(tmp_path)]))
    try:
        assert s.lookup("r", [key(i) for i in range(9)]) == ["HIT"] * 8 + ["MISS"]
        assert s.mismatches == 0
        s.end("r")
        s.settle()
    finally:
        s.close()
