"""CRC-32C (Castagnoli) for the tcp transport: which implementation this process uses.

In order of preference:

1. ``tierkv.transports._crc32c`` (transports/_crc32c.c): built at install time by setup.py where
   a C compiler exists. SSE4.2 ``crc32`` lanes plus, on CPUs with AVX2 and VPCLMULQDQ, a lane
   folded with carry-less multiplies (the algorithm is drawn in the C file). x86-64 only.
2. the ``crc32c`` package from PyPI (``pip install crc32c``; wheels for the common platforms),
   when it is installed: what an install without a compiler can add to keep CRC-32C.
3. none: `native_crc32c()` is None and checksum.py offers zlib's CRC-32 only.

Measured in one run (benchmarks/checksum.py; docs/transports.md has the figures): ours is the
faster at 256 KB and 1 MB and level at 16 KB, so it stays first and the package is not a
dependency. ``TIERKV_NATIVE_CHECKSUM=0`` disables both (a peer without CRC-32C);
``TIERKV_CRC32C_FOLD=0`` starts ours without the folded lane.
"""

from __future__ import annotations

import functools
import importlib
import os
from array import array
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .errors import TransportError

__all__ = [
    "Crc",
    "crc32c",
    "crc32c_rows",
    "implementation",
    "native_crc32c",
    "reselect",
    "select_fold",
    "slot_kernels",
]

#: `fn(data, crc)`: the CRC-32C of everything so far (`crc`) followed by the buffer `data`.
Crc = Callable[[Any, int], int]


def _extension() -> ModuleType | None:
    try:  # through sys.modules, so that a test can hide the module
        return importlib.import_module(f"{__package__}._crc32c")
    except ImportError:  # not built: no compiler at install time, or TIERKV_NO_EXTENSIONS=1
        return None


def _package() -> ModuleType | None:
    try:
        return importlib.import_module("crc32c")
    except ImportError:
        return None


@functools.cache
def _selected() -> tuple[str, Crc] | None:
    if os.environ.get("TIERKV_NATIVE_CHECKSUM", "1") == "0":
        return None
    ours = _extension()
    if ours is not None and ours.init(os.environ.get("TIERKV_CRC32C_FOLD", "1") != "0"):
        return "tierkv", ours.crc32c
    package = _package()
    if package is not None:
        return "crc32c package", package.crc32c
    return None


def native_crc32c() -> Crc | None:
    """The CRC-32C function in use (``fn(data, crc) -> crc``; releases the GIL on large
    buffers), or None where neither the extension nor the ``crc32c`` package can be used here
    (or ``TIERKV_NATIVE_CHECKSUM=0``). Never raises."""
    selected = _selected()
    return None if selected is None else selected[1]


def slot_kernels() -> Any:
    """The extension where it is the CRC-32C in use, for its batch kernels of the disk medium's
    slot headers (``check_slots`` / ``pack_slots``: a run of pages with the GIL released
    once); None elsewhere (the disk medium then checks and packs headers in Python)."""
    ours = _extension()
    if ours is None or implementation() != "tierkv" or not hasattr(ours, "check_slots"):
        return None
    return ours


def implementation() -> str:
    """Who computes CRC-32C here: "tierkv" (the extension), "crc32c package", or ""."""
    selected = _selected()
    return "" if selected is None else selected[0]


def select_fold(fold: bool) -> int:
    """Switch the extension's folded lane on or off (tests compare both paths). Returns 2 when
    the folded lane is in use, 1 for the crc32 lanes only, 0 where the extension is not used.
    Not safe while another thread computes a checksum."""
    ours = _extension()
    if ours is None or implementation() != "tierkv":
        return 0
    return ours.init(fold)


def reselect() -> None:
    """Choose the implementation again on next use (after the environment changed; tests)."""
    _selected.cache_clear()


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of a contiguous buffer, continuing from `crc`. Raises TransportError where no
    implementation is available (see `native_crc32c`)."""
    fn = native_crc32c()
    if fn is None:
        raise TransportError(
            "no CRC-32C implementation here: tierkv.transports._crc32c was not built at install "
            "time and the crc32c package is not installed (or TIERKV_NATIVE_CHECKSUM=0)"
        )
    return fn(data, crc)


def crc32c_rows(rows: Any, slots: Sequence[int]) -> list[int]:
    """CRC-32C of ``rows[s]`` for each ``s`` of ``slots`` (``rows``: a C-contiguous 2-D uint8
    array, one page per row): one native call over all of them where the extension is in
    use (it releases the GIL), one call per row with the ``crc32c`` package. Raises
    TransportError where no implementation is available, IndexError for a slot outside
    ``rows``."""
    if not slots:
        return []
    ours = _extension()
    if ours is not None and implementation() == "tierkv":
        row_bytes = rows.shape[1]
        out = ours.crc32c_rows(rows, row_bytes, array("q", slots))
        return array("I", out).tolist()
    n = rows.shape[0]
    for s in slots:
        if not 0 <= s < n:
            raise IndexError(f"crc32c_rows: row {s} outside [0, {n})")
    return [crc32c(rows[s]) for s in slots]
