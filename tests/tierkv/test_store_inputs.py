"""One error tree at the boundary (issue 13, finding 7): bad inputs to KVStore, Lease and
SyncKVStore raise tierkv errors at entry and change nothing; runtime errors leave the store
mapped (``raise ... from``); token ids have a range, sequence ids one type; long prompts are
hashed in slices that give the loop a turn."""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import tierkv
from tierkv import prompt
from tierkv.codecs import UnknownCodecError
from tierkv.errors import (
    AllocationError,
    EngineError,
    InvalidInputError,
    InvalidTypeError,
    SequenceError,
    SpecError,
    StoreClosedError,
    StoreTimeoutError,
    TierKVError,
    TransferFailedError,
    UnknownPolicyError,
)
from tierkv.lease import Lease
from tierkv.runtime import TransferError, WaitTimeoutError
from tierkv.runtime.errors import UnknownBackendError
from tierkv.store import KVStore
from tierkv.sync import SyncKVStore

SPEC = tierkv.KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="fp32", page_tokens=4)
PAGE = SPEC.page_bytes
H, D = SPEC.num_kv_heads, SPEC.head_dim


def kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((H, n, D), generator=g), torch.randn((H, n, D), generator=g)


def store_of(**kw: Any) -> KVStore:
    return KVStore(SPEC, **{"device_bytes": 16 * PAGE, "host_bytes": 64 * PAGE, **kw})


async def usable(store: KVStore) -> None:
    """The store still works after a rejected call: invariants hold, a new sequence round-trips
    and the existing one ("a") still reads back."""
    store.check()
    sid = f"ok-{len(store._seqs)}"
    await store.add_sequence(sid, [7, 8, 9, 10, 11])
    k, v = kv(5, 42)
    async with store.lease([sid, "a"]) as lease:
        for layer in range(SPEC.num_layers):
            await lease.append(sid, layer, k, v)
        got_k, got_v = lease.kv(sid, 1)
        assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert lease.kv("a", 0)[0].shape == (H, 6, D)
    await store.release(sid)
    await store.drain()
    store.check()


# -- bad inputs: each gets a typed error at entry, and the store stays usable ----------------
META = torch.empty((H, 1, D), device="meta")
K1, V1 = kv(1, 1)

STORE_CALLS: dict[str, tuple[type[TierKVError], Callable[[KVStore], Any]]] = {
    "str prompt": (InvalidTypeError, lambda s: s.add_sequence("b", "hello")),
    "None prompt": (InvalidTypeError, lambda s: s.add_sequence("b", None)),
    "float token": (InvalidTypeError, lambda s: s.add_sequence("b", [1, 2.5, 3])),
    "integral floats": (InvalidTypeError, lambda s: s.add_sequence("b", [1.0, 2.0])),
    "None token": (InvalidTypeError, lambda s: s.add_sequence("b", [1, None])),
    "str tokens": (InvalidTypeError, lambda s: s.add_sequence("b", ["1", "2"])),
    "bool tokens": (InvalidTypeError, lambda s: s.add_sequence("b", [True, False])),
    "token -1": (SpecError, lambda s: s.add_sequence("b", [5, -1, 6])),
    "token 2**64-1": (SpecError, lambda s: s.add_sequence("b", [2**64 - 1])),
    "token 2**32": (SpecError, lambda s: s.add_sequence("b", np.array([2**32]))),
    "2-D prompt": (SpecError, lambda s: s.add_sequence("b", np.ones((2, 4), dtype=np.int64))),
    "float tensor prompt": (InvalidTypeError, lambda s: s.add_sequence("b", torch.ones(4))),
    "None seq id": (InvalidTypeError, lambda s: s.add_sequence(None, [1, 2])),
    "float seq id": (InvalidTypeError, lambda s: s.add_sequence(5.0, [1, 2])),
    "empty seq id": (InvalidInputError, lambda s: s.add_sequence("", [1, 2])),
    "lookup float": (InvalidTypeError, lambda s: s.lookup([0.5, 1.5])),
    "lookup -1": (SpecError, lambda s: s.lookup([-1] * 8)),
    "add_tokens None": (InvalidTypeError, lambda s: s.add_tokens("a", [None])),
    "add_tokens str": (InvalidTypeError, lambda s: s.add_tokens("a", "xyz")),
    "lease a str": (InvalidTypeError, lambda s: s.lease("a")),
    "lease float layer": (InvalidTypeError, lambda s: s.lease(["a"], layers=[1.0])),
    "lease int layers": (InvalidTypeError, lambda s: s.lease(["a"], layers=1)),
    "lease layer 9": (SpecError, lambda s: s.lease(["a"], layers=[9])),
    "release None": (InvalidTypeError, lambda s: s.release(None)),
    "prefetch timeout 0": (InvalidInputError, lambda s: s.prefetch(["a"], wait=True, timeout=0)),
    "schedule a str": (InvalidTypeError, lambda s: s.schedule("a")),
    "sequence of a list": (InvalidTypeError, lambda s: s.sequence(["a"])),
}


def _quiet(make: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``make()`` without torch's beta / prototype warnings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return make()


def _fake(x: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode().from_tensor(x)


# other layouts and tensors without data (issue 23: a sparse k raised torch's RuntimeError)
ODD_TENSORS: dict[str, Callable[[], torch.Tensor]] = {
    "sparse COO": lambda: K1.to_sparse(),
    "sparse CSR": lambda: K1.to_sparse_csr(),
    "sparse CSC": lambda: K1.to_sparse(layout=torch.sparse_csc),
    "sparse BSR": lambda: _quiet(lambda: K1.to_sparse(layout=torch.sparse_bsr, blocksize=(1, 1))),
    "nested (strided)": lambda: _quiet(lambda: torch.nested.nested_tensor([K1[0], K1[1]])),
    "nested (jagged)": lambda: torch.nested.nested_tensor([K1[0], K1[1]], layout=torch.jagged),
    "fake": lambda: _fake(K1),
}
if torch.backends.mkldnn.is_available():
    ODD_TENSORS["mkldnn"] = lambda: K1.to_mkldnn()

LEASE_CALLS: dict[str, tuple[type[TierKVError], Callable[[Lease], Any]]] = {
    "numpy k": (InvalidTypeError, lambda ls: ls.append("a", 0, K1.numpy(), V1.numpy())),
    "list k": (InvalidTypeError, lambda ls: ls.append("a", 0, K1.tolist(), V1)),
    "None k": (InvalidTypeError, lambda ls: ls.append("a", 0, None, None)),
    "None v": (InvalidTypeError, lambda ls: ls.append("a", 0, K1, None)),
    "meta k": (SpecError, lambda ls: ls.append("a", 0, META, META)),
    "fp16 k": (SpecError, lambda ls: ls.append("a", 0, K1.half(), V1.half())),
    "k, v of different n": (SpecError, lambda ls: ls.append("a", 0, K1, kv(2)[1])),
    "2-D k": (SpecError, lambda ls: ls.append("a", 0, K1[0], V1[0])),
    "str layer": (InvalidTypeError, lambda ls: ls.append("a", "0", K1, V1)),
    "None seq in append": (InvalidTypeError, lambda ls: ls.append(None, 0, K1, V1)),
    "float layer in kv": (InvalidTypeError, lambda ls: ls.kv("a", 0.0)),
    "unknown seq in kv": (SequenceError, lambda ls: ls.kv("zz", 0)),
    **{
        f"{name} k": (SpecError, lambda ls, make=make: ls.append("a", 0, make(), V1))
        for name, make in ODD_TENSORS.items()
    },
    **{
        f"{name} v": (SpecError, lambda ls, make=make: ls.append("a", 0, K1, make()))
        for name, make in ODD_TENSORS.items()
    },
}


def snapshot(store: KVStore) -> tuple[object, ...]:
    """What a rejected call must leave as it was."""
    seqs = {sid: (list(s.tokens), list(s.blocks), list(s.kv_len)) for sid, s in store._seqs.items()}
    return seqs, store.tiers.table.used("device"), dict(store.tiers.ownership.owners)


async def _filled() -> KVStore:
    store = await store_of().open()
    await store.add_sequence("a", [1, 2, 3, 4, 5, 6])
    k, v = kv(6, 3)
    async with store.lease(["a"]) as lease:
        for layer in range(SPEC.num_layers):
            await lease.append("a", layer, k, v)
    return store


@pytest.mark.parametrize("case", sorted(STORE_CALLS))
async def test_bad_store_input_is_typed_and_changes_nothing(case: str) -> None:
    err, call = STORE_CALLS[case]
    store = await _filled()
    try:
        before = snapshot(store)
        with pytest.raises(err):
            got = call(store)
            if asyncio.iscoroutine(got):
                await got
        assert snapshot(store) == before
        await usable(store)
    finally:
        await store.close()


@pytest.mark.parametrize("case", sorted(LEASE_CALLS))
async def test_bad_lease_input_is_typed_and_changes_nothing(case: str) -> None:
    err, call = LEASE_CALLS[case]
    store = await _filled()
    try:
        async with store.lease(["a"]) as lease:
            used = store.tiers.table.used("device")
            with pytest.raises(err):
                got = call(lease)
                if asyncio.iscoroutine(got):
                    await got
            assert store.tiers.table.used("device") == used
            assert store.sequence("a").kv_len == [6, 6]
        await usable(store)
    finally:
        await store.close()


CONSTRUCTION: dict[str, tuple[type[TierKVError], dict[str, Any]]] = {
    'device_bytes="1G"': (InvalidTypeError, {"device_bytes": "1G"}),
    "device_bytes=8e9": (InvalidTypeError, {"device_bytes": 8e9}),
    "host_bytes=None": (InvalidTypeError, {"host_bytes": None}),
    "device_bytes=-1": (InvalidInputError, {"device_bytes": -1}),
    "device_bytes=1 (no page)": (SpecError, {"device_bytes": 1}),
    "timeout=0": (InvalidInputError, {"timeout": 0}),
    "timeout=-1": (InvalidInputError, {"timeout": -1.0}),
    "timeout=nan": (InvalidInputError, {"timeout": float("nan")}),
    "timeout=10**400": (InvalidInputError, {"timeout": 10**400}),  # was float()'s OverflowError
    # past threading.TIMEOUT_MAX: SyncKVStore's thread waits raised OverflowError
    "timeout=1e300": (InvalidInputError, {"timeout": 1e300}),
    "turn_budget=1e300": (InvalidInputError, {"turn_budget": 1e300}),
    "remote_push_wait=1e300": (InvalidInputError, {"remote_push_wait": 1e300}),
    "cold_fraction=10**400": (InvalidInputError, {"cold_fraction": 10**400}),
    'timeout="5"': (InvalidTypeError, {"timeout": "5"}),
    "policy=nope": (UnknownPolicyError, {"policy": "nope"}),  # also an InvalidInputError
    "codec=5": (InvalidTypeError, {"codec": 5}),
    "codec=zstd": (UnknownCodecError, {"codec": "zstd"}),  # at entry, not at open()
    "backend=tpu": (UnknownBackendError, {"backend": "tpu"}),  # at entry, not at open()
    "backend=7": (InvalidTypeError, {"backend": 7}),
    "cold_fraction=1.5": (InvalidInputError, {"cold_fraction": 1.5}),
    "max_inflight=0": (InvalidInputError, {"max_inflight": 0}),
    'write_behind="no"': (InvalidTypeError, {"write_behind": "no"}),
    "namespace=object()": (InvalidTypeError, {"namespace": object()}),
}


@pytest.mark.parametrize("case", sorted(CONSTRUCTION))
def test_bad_construction_is_typed(case: str) -> None:
    err, kw = CONSTRUCTION[case]
    with pytest.raises(err):
        store_of(**kw)
    with pytest.raises(err):  # the blocking store checks before it starts its loop thread
        threads = threading.active_count()
        try:
            SyncKVStore(SPEC, **{"device_bytes": 16 * PAGE, "host_bytes": 64 * PAGE, **kw})
        finally:
            assert threading.active_count() == threads


def test_bad_spec_and_unknown_arguments_are_typed() -> None:
    with pytest.raises(InvalidTypeError):
        KVStore("spec", device_bytes=1 << 20, host_bytes=1 << 20)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="bogus"):
        SyncKVStore(SPEC, device_bytes=16 * PAGE, host_bytes=64 * PAGE, bogus=1)


SYNC_CALLS: dict[str, tuple[type[TierKVError], Callable[[SyncKVStore], Any]]] = {
    "sync float token": (InvalidTypeError, lambda s: s.add_sequence("b", [1.5])),
    "sync token -1": (SpecError, lambda s: s.lookup([-1, 3, 4, 5])),
    "sync None seq": (InvalidTypeError, lambda s: s.add_tokens(None, [1])),
    "sync lease a str": (InvalidTypeError, lambda s: s.lease("a").__enter__()),
    "sync release unknown": (SequenceError, lambda s: s.release("nope")),
}


@pytest.mark.parametrize("case", sorted(SYNC_CALLS))
def test_bad_sync_input_is_typed(case: str) -> None:
    err, call = SYNC_CALLS[case]
    with SyncKVStore(SPEC, device_bytes=16 * PAGE, host_bytes=64 * PAGE) as store:
        store.add_sequence("a", [1, 2, 3, 4, 5])
        with pytest.raises(err):
            call(store)
        with store.lease(["a"]) as lease:
            with pytest.raises(InvalidTypeError):
                lease.append("a", 0, None, None)  # type: ignore[arg-type]
            k, v = kv(5)
            lease.append("a", 0, k, v)
            assert torch.equal(lease.kv("a", 0)[0], k)
        store.call(store.store.check)


def test_the_bad_inputs_number_at_least_25() -> None:
    assert len(STORE_CALLS) + len(LEASE_CALLS) + len(CONSTRUCTION) + len(SYNC_CALLS) >= 25


# -- ids ------------------------------------------------------------------------------------
async def test_token_ids_minus_one_and_two_to_the_64_no_longer_share_a_key() -> None:
    async with store_of() as store:
        await store.add_sequence("a", list(range(9)))
        with pytest.raises(SpecError):
            store.lookup([2**64 - 1] * 8)
        with pytest.raises(SpecError):
            tierkv.prefix_keys([-1] * 8, 4)
        with pytest.raises(SpecError):
            tierkv.keys.block_key(tierkv.keys.root_key(), np.array([2**64 - 1], dtype=np.uint64))


async def test_tokens_of_every_accepted_form_give_the_same_keys() -> None:
    toks = list(range(100, 117))
    forms: list[Any] = [
        toks,
        tuple(toks),
        range(100, 117),
        np.array(toks, dtype=np.int32),
        np.array(toks, dtype=np.uint64),
        torch.tensor(toks),
        [np.int64(t) for t in toks],
    ]
    async with store_of() as store:
        await store.add_sequence("a", toks)
        async with store.lease(["a"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("a", layer, *kv(16, layer))
        await store.release("a")
        for form in forms:
            assert store.lookup(form) == 16
            assert await store.fetch_prefix(form) == 16
        for i, form in enumerate(forms):
            assert await store.add_sequence(f"s{i}", form) == 16
            assert store.sequence(f"s{i}").tokens == toks


async def test_int_sequence_ids_are_their_decimal_string() -> None:
    async with store_of() as store:
        await store.add_sequence(5, [1, 2, 3])
        with pytest.raises(SequenceError, match="already exists"):
            await store.add_sequence("5", [4, 5, 6])  # the same sequence, never a second one
        assert store.sequence(5) is store.sequence("5") is store.sequence(np.int64(5))
        async with store.lease([5]) as lease:
            await lease.append(5, 0, *kv(3))
            assert lease.kv("5", 0)[0].shape == (H, 3, D)
            assert lease.sequences() == ["5"]
        await store.release("5")
        with pytest.raises(SequenceError):
            store.sequence(5)
        with pytest.raises(InvalidTypeError):
            await store.add_sequence(True, [1])


# -- runtime errors leave the store mapped ----------------------------------------------------
async def test_a_failed_copy_is_a_transfer_failed_error_from_the_runtime_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with store_of(device_bytes=4 * PAGE, write_behind=False, codec=None) as store:
        await store.add_sequence("a", list(range(8)))
        ka, va = kv(8, 1)
        async with store.lease(["a"]) as lease:
            for layer in range(SPEC.num_layers):
                await lease.append("a", layer, ka, va)
        await store.add_sequence("b", list(range(50, 58)))
        async with store.lease(["b"]) as lease:  # evicts a's pages to the host
            for layer in range(SPEC.num_layers):
                await lease.append("b", layer, *kv(8, 2))
        backend = store._engine.backend  # type: ignore[union-attr]
        real = backend.copy_slots

        def broken(*args: Any) -> Any:
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(backend, "copy_slots", broken)
        with pytest.raises(TransferFailedError, match="injected") as info:
            async with store.lease(["a"]):
                pass
        assert isinstance(info.value.__cause__, TransferError)
        assert isinstance(info.value, EngineError)
        monkeypatch.setattr(backend, "copy_slots", real)
        await store.drain()
        store.check()
        async with store.lease(["a"]) as lease:
            got_k, got_v = lease.kv("a", 1)
            assert torch.equal(got_k, ka) and torch.equal(got_v, va)


async def test_a_runtime_timeout_is_a_store_timeout_error(monkeypatch: pytest.MonkeyPatch) -> None:
    async with store_of() as store:
        await store.add_sequence("a", [1, 2, 3])

        async def stalled(*args: Any, **kw: Any) -> int:
            raise WaitTimeoutError("event not set after 0.1 s")

        monkeypatch.setattr(store.tiers, "acquire_device", stalled)
        with pytest.raises(StoreTimeoutError) as info:
            async with store.lease(["a"]):
                pass
        assert isinstance(info.value, TimeoutError)
        assert isinstance(info.value.__cause__, WaitTimeoutError)
        monkeypatch.undo()
        store.check()
        async with store.lease(["a"]) as lease:
            await lease.append("a", 0, *kv(3))


async def test_a_tier_that_cannot_be_mapped_is_an_allocation_error() -> None:
    with pytest.raises(SpecError, match="over the"):  # 2**40 pages: more than a tier holds
        KVStore(SPEC, device_bytes=PAGE << 40, host_bytes=64 * PAGE)
    big = tierkv.KVSpec(num_layers=2, num_kv_heads=4, head_dim=64, dtype="fp16", page_tokens=1024)
    store = KVStore(big, device_bytes=big.page_bytes << 28, host_bytes=64 * big.page_bytes)
    with pytest.raises(AllocationError, match="cannot map"):  # 256 TiB in 2**28 pages
        await store.open()
    assert isinstance(store, KVStore)
    await store.close()
    with pytest.raises(StoreClosedError):
        await store.open()


def test_a_sync_call_past_its_bound_is_a_store_timeout_error() -> None:
    with SyncKVStore(SPEC, device_bytes=16 * PAGE, host_bytes=64 * PAGE, timeout=0.05) as store:

        async def slow() -> None:
            await asyncio.sleep(1.0)

        with pytest.raises(StoreTimeoutError, match="no answer"):
            store.run(slow())
        store.add_sequence("a", [1, 2])  # the loop is still serving


# -- long prompts ------------------------------------------------------------------------------
async def test_a_long_prompt_gives_the_loop_turns_while_it_is_hashed() -> None:
    """Structure, not time: a task scheduled next to a 1M-token add_sequence runs many times
    before it returns (one turn per slice); the measured block is in docs/store.md."""
    n = 1_000_000
    ticks = 0
    done = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0)

    async with store_of() as store:
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = ticks
        cached = await store.add_sequence("long", list(range(n)))
        during = ticks - start
        done.set()
        await task
        assert cached == 0
        slices = -(-n // prompt.SLICE_TOKENS)
        assert during >= slices - 1, f"{during} loop turns while hashing {slices} slices"
        assert len(store.sequence("long").tokens) == n
        short = ticks
        await store.add_sequence("short", list(range(100)))
        assert ticks == short  # a prompt under one slice never yields


async def test_the_same_id_added_while_a_long_prompt_hashes_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first add of an id holds it while in flight (tierkv.seq_flight): the second is
    refused at once, before any work (it used to hash and register, and the first, long one
    then failed with "already exists")."""
    monkeypatch.setattr(prompt, "SLICE_TOKENS", 64)
    async with store_of() as store:
        adding = asyncio.create_task(store.add_sequence("x", list(range(1000))))
        await asyncio.sleep(0)
        with pytest.raises(SequenceError, match="'x' is being added already"):
            await store.add_sequence("x", [1, 2, 3])  # same id, added while the first hashes
        await adding
        assert store.sequence("x").tokens == list(range(1000))
        store.check()


async def test_kv_that_requires_grad_is_stored_as_values() -> None:
    """Appending a tensor that requires grad once made the arena view part of its autograd
    graph: every later kv() required grad and the graph grew with each append."""
    async with store_of() as store:
        await store.add_sequence("a", [1, 2, 3])
        k, v = (x.requires_grad_() for x in kv(3, 5))
        async with store.lease(["a"]) as lease:
            await lease.append("a", 0, k, v)
            got_k, got_v = lease.kv("a", 0)
        assert not got_k.requires_grad and not got_v.requires_grad
        assert not store.tiers.pages.page(0).requires_grad
        assert torch.equal(got_k, k.detach()) and torch.equal(got_v, v.detach())


def test_a_sync_run_of_something_else_is_a_type_error() -> None:
    """SyncKVStore.run(5) awaited 5 on the loop thread: a TypeError; now InvalidTypeError
    before anything is sent to the loop."""
    with SyncKVStore(SPEC, device_bytes=16 * PAGE, host_bytes=64 * PAGE) as store:
        with pytest.raises(InvalidTypeError, match="coroutine"):
            store.run(5)  # type: ignore[arg-type]
        store.add_sequence("a", [1, 2])  # still serving
