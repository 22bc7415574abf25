"""setup.py's native extensions are optional: without a working C compiler the build warns and
succeeds with nothing built (the library then uses its fallbacks); with one, all are built."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_setup = pytest.mark.skipif(not (ROOT / "setup.py").exists(), reason="no source tree")


def _build_ext(tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "-b", str(tmp / "lib"), "-t", str(tmp)],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_setup
def test_without_a_compiler_the_build_succeeds_with_nothing_built(tmp_path: Path) -> None:
    out = _build_ext(tmp_path, CC=str(tmp_path / "no-such-compiler"))
    assert out.returncode == 0, out.stderr
    assert "not building tierkv.runtime._copy" in out.stderr
    assert "not building tierkv.transports._crc32c" in out.stderr
    assert "not building tierkv.policies._kvaware" in out.stderr
    assert "not building tierkv.codecs._dequant" in out.stderr
    assert "not building tierkv._tally" in out.stderr
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.pyd"))


@needs_setup
def test_extensions_can_be_skipped_on_purpose(tmp_path: Path) -> None:
    out = _build_ext(tmp_path, TIERKV_NO_EXTENSIONS="1")
    assert out.returncode == 0, out.stderr
    assert not list(tmp_path.rglob("*.so"))


@needs_setup
@pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler")
def test_with_a_compiler_both_extensions_are_built(tmp_path: Path) -> None:
    out = _build_ext(tmp_path)
    assert out.returncode == 0, out.stderr
    lib = tmp_path / "lib"
    built = sorted(
        ".".join(p.relative_to(lib).parts).split(".cpython")[0] for p in lib.rglob("*.so")
    )
    assert built == [
        "tierkv._tally",
        "tierkv.codecs._dequant",
        "tierkv.policies._kvaware",
        "tierkv.runtime._copy",
        "tierkv.transports._crc32c",
    ]
