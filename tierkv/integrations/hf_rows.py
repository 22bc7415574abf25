"""The store side of :class:`~tierkv.integrations.hf.TieredCache`: its batch rows as store
sequences. These coroutines run on the store's loop (one hop per call from the model's thread).

A ``Cache`` has one length for all its rows, so rows that start from a cached prefix must all
start from the same one::

    row 0  [p p p p|p p p p|p p p p|p p]   3 blocks cached
    row 1  [p p p p|p p p p|q q q q|q]     2 blocks cached
            <-- reused: 8 --> generate() computes the rest of both rows

``add_rows`` takes the shortest cached prefix of the rows; ``copy_rows`` makes new sequences
holding the same tokens and KV as others (shared full blocks by reference, the rest copied).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tierkv.errors import InvalidTypeError, SequenceError, SpecError
from tierkv.store import KVStore


async def add_rows(
    store: KVStore,
    ids: Sequence[str],
    rows: Sequence[Sequence[int] | None],
    salt: bytes | None = None,
    tenant: str | None = None,
) -> int:
    """Start one sequence per row; returns the tokens of KV every row reuses (the same count).
    ``salt``, ``tenant``: every row's cache salt and tenant (:meth:`KVStore.add_sequence`).

    A row of ``None`` declares no tokens (a padded row: its KV depends on the padding, so it
    shares nothing and the batch reuses nothing). At least one token of each row is left to
    compute. Raises what :meth:`KVStore.add_sequence` raises; on an error no row is left added.
    """
    t = store.spec.page_tokens
    if any(r is None for r in rows):
        reuse = 0
    else:
        reuse = min(store.lookup(r, salt=salt) for r in rows if r is not None)
        reuse = min(reuse, min((len(r) - 1) // t * t for r in rows if r is not None))
    while True:
        added: list[str] = []
        got: list[int] = []
        try:
            for sid, row in zip(ids, rows):
                if row is None:
                    got.append(await store.add_sequence(sid, [], salt=salt, tenant=tenant))
                    added.append(sid)
                    continue
                # reuse is capped at (len - 1) // t blocks: declare reuse + 1 tokens first
                got.append(
                    await store.add_sequence(sid, row[: reuse + 1], salt=salt, tenant=tenant)
                )
                added.append(sid)
                store.add_tokens(sid, row[reuse + 1 :])
        except BaseException:
            for sid in added:
                await store.release(sid)
            raise
        if min(got) == reuse:
            return reuse
        # blocks were evicted between the lookup and an add (other tasks ran): retry with less
        for sid in added:
            await store.release(sid)
        reuse = min(got)


async def copy_rows(store: KVStore, src: Sequence[str], dst: Sequence[str]) -> None:
    """Start ``dst[i]`` holding ``src[i]``'s tokens and KV, independent of it from now on.

    Full blocks with content keys are shared (immutable: reading them is the same as a copy;
    a copy keeps its source's salt and tenant);
    the rest is read from the source's pages and appended, one layer of all rows per lease.
    Raises SequenceError for an unknown source or a used destination id, TierKVError from the
    store (no room); on an error no destination is left added.
    """
    layers = store.spec.num_layers
    lengths: list[int] = []
    reused: list[int] = []
    added: list[str] = []
    try:
        for s, d in zip(src, dst):
            seq = store.sequence(s)
            tenant = (
                None
                if seq.tenant is None or store.tenants is None
                else store.tenants.names[seq.tenant]
            )
            length = seq.length
            if any(n != length for n in seq.kv_len):
                raise SequenceError(f"sequence {s!r} is inside a forward (layers differ)")
            toks = list(seq.tokens)
            if toks and len(toks) > length:
                n = await store.add_sequence(d, toks[: length + 1], salt=seq.salt, tenant=tenant)
                added.append(d)
                store.add_tokens(d, toks[length + 1 :])
            else:
                n = await store.add_sequence(d, toks, salt=seq.salt, tenant=tenant)
                added.append(d)
            lengths.append(length)
            reused.append(n)
        for layer in range(layers):
            async with store.lease([*src, *dst], [layer]) as lease:
                for s, d, n, length in zip(src, dst, reused, lengths):
                    if n < length:
                        k, v = lease.kv(s, layer)
                        await lease.append(d, layer, k[:, n:length], v[:, n:length])
    except BaseException:
        for d in added:
            await store.release(d)
        raise


def token_rows(x: Any, what: str) -> list[list[int]]:
    """``[B, S]`` token ids (a tensor, or nested lists; a flat list is one row) as lists of
    ints. Raises SpecError for a float or non-2-D tensor or an empty row, InvalidTypeError for
    anything else that is not a tensor or a non-empty list."""
    if isinstance(x, torch.Tensor):
        if x.dim() == 1:
            x = x.unsqueeze(0)
        if x.dim() != 2 or x.dtype.is_floating_point or x.dtype.is_complex:
            raise SpecError(
                f"{what}: want an integer [batch, tokens] tensor, got {x.dtype} {tuple(x.shape)}"
            )
        return [[int(t) for t in row] for row in x.tolist()]
    if not isinstance(x, (list, tuple)) or not x:
        raise InvalidTypeError(f"{what}: want a tensor or a non-empty list, got {type(x).__name__}")
    rows = x if isinstance(x[0], (list, tuple)) else [x]
    if any(not r for r in rows):
        raise SpecError(f"{what}: a row has no tokens")
    return [list(r) for r in rows]
