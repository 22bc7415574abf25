"""Prompts to page keys without blocking the event loop.

A prompt is checked (:func:`tierkv.validate.token_array`) and its full blocks hashed
(:func:`tierkv.keys.chain_keys`) in slices of about :data:`SLICE_TOKENS` tokens, with a loop turn
between slices::

    tokens  [ slice 0 | slice 1 | ... ]     each slice a whole number of blocks
              check, hash, to ints  -> await asyncio.sleep(0) -> next slice (parent key carried)

A slice costs ~1-2 ms on one core (a 1M-token prompt: ~125 slices of 8k tokens), so other tasks
(decode steps, copies completing) run between slices. A prompt shorter than one slice never
yields. The keys are exactly :func:`tierkv.keys.prefix_keys`'s.
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tierkv.errors import InvalidTypeError
from tierkv.keys import PageKey, chain_keys, root_key
from tierkv.validate import token_array

SLICE_TOKENS = 8192
"""Tokens checked and hashed per loop turn (rounded down to whole blocks, at least one)."""


async def prompt_keys(
    tokens: object,
    page_tokens: int,
    namespace: Any = None,
    what: str = "tokens",
    *,
    salt: bytes | None = None,
) -> tuple[array[int], list[PageKey]]:
    """``tokens`` as a flat ``array('q')`` of ids, and the content keys of its full blocks.

    Yields to the loop between slices of a long prompt. Raises InvalidTypeError or SpecError
    (see :func:`tierkv.validate.token_array`) before anything is hashed when the container is
    wrong, or at the first bad slice. ``salt``: a checked cache salt
    (:func:`tierkv.keys.root_key`).
    """
    if isinstance(tokens, torch.Tensor | np.ndarray):
        if tokens.ndim != 1:
            token_array(tokens, what)  # raises SpecError: not 1-D
    elif isinstance(tokens, str | bytes | bytearray | memoryview) or not isinstance(
        tokens, Sequence
    ):
        token_array(tokens, what)  # raises InvalidTypeError
        raise InvalidTypeError(f"{what}: expected a sequence of ints")  # not reached
    n = len(tokens)
    size = max(1, SLICE_TOKENS // page_tokens) * page_tokens
    if n <= size:
        arr = token_array(tokens, what)
        return _ids(arr), chain_keys(root_key(namespace, salt), arr, page_tokens)
    parent = root_key(namespace, salt)
    ids: array[int] = array("q")
    keys: list[PageKey] = []
    for start in range(0, n, size):
        arr = token_array(tokens[start : start + size], f"{what}[{start}:]")
        ids.extend(_ids(arr))
        got = chain_keys(parent, arr, page_tokens)
        if got:
            keys += got
            parent = got[-1]
        if start + size < n:
            await asyncio.sleep(0)
    return ids, keys


def _ids(arr: np.ndarray[Any, Any]) -> array[int]:
    """Checked int64 ids as an ``array('q')`` (one bulk copy, no Python int per token)."""
    out: array[int] = array("q")
    out.frombytes(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return out
