"""Prompts to keys in slices (tierkv/prompt.py) and the fast key chain (keys.chain_keys): the
same keys as block_key chained block by block, whatever the slice size, and the same keys as
before the fast path (pinned hex values, computed by the per-block implementation)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import prompt
from tierkv.keys import block_key, chain_keys, prefix_keys, root_key
from tierkv.validate import TOKEN_ID_LIMIT


def reference(tokens: list[int], page_tokens: int, namespace: object = None) -> list[bytes]:
    parent, keys = root_key(namespace), []
    for i in range(len(tokens) // page_tokens):
        parent = block_key(parent, tokens[i * page_tokens : (i + 1) * page_tokens])
        keys.append(parent)
    return keys


def test_keys_are_the_ones_of_the_per_block_implementation() -> None:
    # hex values from prefix_keys before chain_keys existed (one blake2b object per block)
    assert prefix_keys(list(range(32)), 16)[1].hex() == "77e6dc863351cc8a13f8e4dfcd2529a4"
    assert prefix_keys(list(range(32)), 16, "ns")[0].hex() == "516b140246d5ff8fa9776a4990141bbd"


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, TOKEN_ID_LIMIT - 1), max_size=200),
    page_tokens=st.integers(1, 17),
    slice_tokens=st.integers(1, 64),
    namespace=st.one_of(st.none(), st.text(max_size=4), st.integers(0, 9)),
)
def test_sliced_hashing_gives_the_block_by_block_keys(
    tokens: list[int], page_tokens: int, slice_tokens: int, namespace: object
) -> None:
    want = reference(tokens, page_tokens, namespace)
    assert chain_keys(root_key(namespace), np.array(tokens, dtype=np.int64), page_tokens) == want
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(prompt, "SLICE_TOKENS", slice_tokens)
        ids, keys = asyncio.run(prompt.prompt_keys(tokens, page_tokens, namespace))
    assert list(ids) == tokens and keys == want


def test_one_loop_turn_between_slices() -> None:
    turns = 0

    async def main() -> None:
        nonlocal turns
        stop = False

        async def count() -> None:
            nonlocal turns
            while not stop:
                turns += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(count())
        await asyncio.sleep(0)
        turns = 0
        await prompt.prompt_keys(list(range(10 * prompt.SLICE_TOKENS)), 16)
        stop = True
        await task

    asyncio.run(main())
    assert turns == 9  # ten slices, a turn between each two
