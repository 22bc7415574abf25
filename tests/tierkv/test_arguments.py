"""Arguments that do not fit a public signature (a misspelt keyword, one too many, a required
one missing) raise InvalidTypeError (a TypeError and a TierKVError) naming the callable and,
for a keyword, what it takes (tierkv/arguments.py); before, Python's bare TypeError left the
public API (KVStore(host_byte=...), Quota(disk_limit=...), store.add_sequence(tenent=...))."""

from __future__ import annotations

from typing import Any

import pytest

from tierkv import Cold, Device, Disk, Host, KVSpec, KVStore, Quota, Remote
from tierkv.errors import InvalidTypeError, TierKVError
from tierkv.serving import Engine, EngineConfig, SamplingParams, TinyModel

from .test_store import PAGE, SPEC

CASES: list[tuple[str, Any]] = [
    ("KVStore", lambda: KVStore(SPEC, device_bytes=16 * PAGE, host_byte=64 * PAGE)),
    ("KVStore", lambda: KVStore()),
    ("KVSpec", lambda: KVSpec(2, 2, 16, page_token=4)),
    ("KVSpec", lambda: KVSpec(2, 2, 16, "fp32", 4, 1, 1)),
    ("Quota", lambda: Quota(disk_limit=1 << 20)),
    ("Device", lambda: Device(byte=1 << 20)),
    ("Host", lambda: Host(1 << 20)),
    ("Cold", lambda: Cold(bytes=1 << 20, codex="int8")),
    ("Disk", lambda: Disk(path="/tmp", size=1 << 20)),
    ("Remote", lambda: Remote(source=[])),
    ("EngineConfig", lambda: EngineConfig(page_token=16)),
    ("SamplingParams", lambda: SamplingParams(max_token=4)),
    ("Engine", lambda: Engine(TinyModel(), EngineConfig(), stor=None)),
]


@pytest.mark.parametrize(
    ("name", "call"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
)
def test_a_constructor_called_wrong_raises_a_typed_error(name: str, call: Any) -> None:
    with pytest.raises(InvalidTypeError, match=f"^{name}: ") as got:
        call()
    assert isinstance(got.value, TypeError) and isinstance(got.value, TierKVError)


def test_a_misspelt_keyword_says_what_it_takes() -> None:
    with pytest.raises(
        InvalidTypeError, match=r"Quota: unexpected keyword argument 'disk_limit' \(it takes "
    ):
        Quota(disk_limit=1 << 20)
    with pytest.raises(InvalidTypeError, match=r"'host_byte' .*host_bytes"):
        KVStore(SPEC, device_bytes=16 * PAGE, host_byte=64 * PAGE)


async def test_a_store_method_called_wrong_raises_a_typed_error() -> None:
    async with KVStore(SPEC, device_bytes=16 * PAGE, host_bytes=64 * PAGE) as store:
        with pytest.raises(
            InvalidTypeError, match="add_sequence: unexpected keyword argument 'tenent'"
        ):
            await store.add_sequence("a", [1, 2, 3], tenent="x")  # type: ignore[call-arg]
        with pytest.raises(InvalidTypeError, match="lookup: "):
            store.lookup()  # type: ignore[call-arg]
        with pytest.raises(InvalidTypeError, match="drain: "):
            await store.drain(1.0, 2.0)  # type: ignore[call-arg]
        await store.add_sequence("a", [1, 2, 3])
        with pytest.raises(InvalidTypeError, match="append: "):
            async with store.lease(["a"]) as lease:
                await lease.append("a", 0)  # type: ignore[call-arg]
        assert store.sequence_ids() == ["a"]
        store.check()
