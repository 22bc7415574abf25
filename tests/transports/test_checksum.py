"""The checksum algorithms: every CRC-32C implementation against the definition and against each
other (the extension built at install, with and without its folded lane; the ``crc32c`` package),
the choice between them, and the fallbacks when neither is there."""

from __future__ import annotations

import importlib
import random
import sys
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.transports import TransportError, crc32c_native
from tierkv.transports.checksum import (
    Incremental,
    algorithms,
    checksum_function,
    crc32c,
    native_crc32c,
    update_function,
)

try:
    from tierkv.transports import _crc32c as extension
except ImportError:  # not built here
    extension = None
try:
    package: Any = importlib.import_module("crc32c")
except ImportError:
    package = None

needs_crc32c = pytest.mark.skipif(native_crc32c() is None, reason="no CRC-32C here")
needs_extension = pytest.mark.skipif(
    extension is None or extension.init(True) == 0, reason="tierkv.transports._crc32c not usable"
)


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        c = byte
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        table.append(c)
    return table


_TABLE = _crc32c_table()


def _crc32c_reference(data: bytes, crc: int = 0) -> int:
    """CRC32C straight from its definition (reflected polynomial 0x82F63B78), table-driven."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c = (c >> 8) ^ _TABLE[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


@pytest.fixture
def reselect() -> Iterator[None]:
    """Let a test change how CRC-32C is chosen; choose afresh for the tests after it."""
    crc32c_native.reselect()
    yield
    crc32c_native.reselect()


def _implementations() -> list[tuple[str, Any]]:
    """(name, fn(data, crc) -> crc) for every CRC-32C implementation present."""
    out: list[tuple[str, Any]] = []
    if package is not None:
        out.append(("package", package.crc32c))
    if extension is not None and extension.init(True):
        out.append(("extension", extension.crc32c))
    return out


@needs_crc32c
@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(max_size=4096)
    | st.integers(20_000, 90_000).map(random.Random(5).randbytes)
    | st.sampled_from([16 << 10, 28736, 3 * 28736 + 7]).map(random.Random(6).randbytes),
    skew=st.integers(0, 7),
    cut=st.floats(0, 1),
)
def test_crc32c_matches_its_definition(data: bytes, skew: int, cut: float) -> None:
    buf = bytearray(skew) + data  # unaligned starts too
    view = memoryview(buf)[skew:]
    expected = _crc32c_reference(data)
    k = int(len(data) * cut)  # split anywhere: incremental use gives the same value
    try:
        for fold in (
            False,
            True,
        ):  # crc32 lanes only, then with the folded lane (if the CPU has it)
            crc32c_native.select_fold(fold)
            assert crc32c(view) == expected
            assert crc32c(view[k:], crc32c(view[:k])) == crc32c(bytes(data))  # read-only too
    finally:
        crc32c_native.select_fold(True)


@pytest.mark.skipif(not _implementations(), reason="no CRC-32C implementation here")
@settings(max_examples=60, deadline=None)
@given(
    size=st.integers(0, 100_000) | st.sampled_from([1 << 20, 256 << 10, 16 << 10, 28736 * 2]),
    skew=st.integers(0, 63),
    start=st.integers(0, 2**32 - 1),
    seed=st.integers(0, 2**16),
)
def test_every_implementation_gives_the_same_crc(
    size: int, skew: int, start: int, seed: int
) -> None:
    impls = _implementations()
    data = bytearray(skew) + random.Random(seed).randbytes(size)
    view = memoryview(data)[skew:]
    results = {name: fn(view, start) for name, fn in impls}
    if extension is not None and extension.init(False):
        results["extension, lanes only"] = extension.crc32c(view, start)
        extension.init(True)
    assert len(set(results.values())) == 1, results
    if size <= 4096:
        assert set(results.values()) == {_crc32c_reference(bytes(view), start)}


@needs_crc32c
def test_crc32c_check_value() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the catalogued check value of CRC-32C


@needs_extension
def test_the_extension_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        extension.crc32c(b"x", 1 << 32)
    with pytest.raises(TypeError):
        extension.crc32c("not a buffer")
    with pytest.raises(BufferError):
        extension.crc32c(memoryview(bytearray(8))[::2])  # not contiguous


@needs_extension
def test_the_extension_is_preferred(reselect: None) -> None:
    assert crc32c_native.implementation() == "tierkv"
    assert native_crc32c() is extension.crc32c
    assert algorithms() == ("crc32c", "crc32")


@pytest.mark.skipif(package is None, reason="the crc32c package is not installed")
def test_without_the_extension_the_package_is_used(
    reselect: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tierkv.transports._crc32c", None)  # import fails
    crc32c_native.reselect()
    assert crc32c_native.implementation() == "crc32c package"
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c_native.select_fold(True) == 0  # nothing to switch
    assert algorithms() == ("crc32c", "crc32")


def test_without_either_only_crc32_is_offered(
    reselect: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tierkv.transports._crc32c", None)
    monkeypatch.setitem(sys.modules, "crc32c", None)
    crc32c_native.reselect()
    assert native_crc32c() is None and crc32c_native.implementation() == ""
    assert algorithms() == ("crc32",)
    with pytest.raises(TransportError, match="no CRC-32C implementation"):
        crc32c(b"abc")
    with pytest.raises(ValueError):
        checksum_function("crc32c")
    pieces = [memoryview(b"abc"), memoryview(b"defg")]
    assert checksum_function("crc32")(pieces) == zlib.crc32(b"abcdefg")


def test_the_environment_disables_crc32c(reselect: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERKV_NATIVE_CHECKSUM", "0")
    crc32c_native.reselect()
    assert algorithms() == ("crc32",)


@pytest.mark.parametrize("name", algorithms())
def test_incremental_equals_whole(name: str) -> None:
    rng = random.Random(9)
    pieces = [memoryview(rng.randbytes(rng.choice([0, 1, 999, 70_000]))) for _ in range(40)]
    inc = Incremental(update_function(name), batch=100_000)
    for p in pieces:
        inc.add(p)
    assert inc.finish() == checksum_function(name)(pieces)
    with pytest.raises(ValueError):
        checksum_function("md5")
