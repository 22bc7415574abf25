"""Page keys: 16-byte chained content hashes of token blocks.

A full block's key is ``blake2b(parent_key || extra || token ids)`` truncated to 16 bytes, so a
key names the whole prefix that ends with the block, not just the block. Keys are identical across
processes, machines and Python runs (no ``hash()``, no ``PYTHONHASHSEED``): token ids (ints in
``[0, 2**32)``; anything else is refused) are serialized as little-endian int64, extra keys
(model id, adapter id, multimodal hashes) with msgpack.

Two kinds of key share the 16-byte space and never collide, because the top bit of the first
byte tells them apart:

* **content keys** (top bit 0) name immutable, shareable full blocks;
* **private keys** (top bit 1) name a live sequence's still-growing last block, which no other
  sequence may reuse; they derive from the sequence id and the block index.

A block holds one page per layer; the page of block ``b`` in layer ``l`` is named by the
block's key and the layer (:func:`page_key`)::

    page key (18 bytes) = block key (16 bytes) | layer (2 bytes, little-endian)

Everything that makes or reads keys lives here: the chain (:func:`block_key`, :func:`chain_keys`,
:func:`prefix_keys`, and :func:`unpublished_keys` for a live sequence's blocks), private keys,
page keys and :func:`is_content`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from enum import Enum
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

from tierkv.errors import SpecError
from tierkv.tenant_names import check_salt
from tierkv.validate import TOKEN_ID_LIMIT

KEY_BYTES = 16
PAGE_KEY_BYTES = KEY_BYTES + 2
_PRIVATE_BIT = 0x80
_DOMAIN = b"tierkv/page-key/v1"
_PERSON = b"tierkv-key-v1"
_KEY_LEN = KEY_BYTES.to_bytes(8, "little")
_NO_EXTRA = (0).to_bytes(8, "little")
_SALT = b"salt"  # (a root with a salt hashes four parts, one without two: never the same)

PageKey = bytes
"""A page key: exactly 16 bytes."""


class KeyKind(Enum):
    """What a key names."""

    CONTENT = "content"
    PRIVATE = "private"


def _token_ids(tokens: Any) -> npt.NDArray[Any]:
    arr = np.asarray(tokens.cpu() if hasattr(tokens, "cpu") else tokens)
    if arr.ndim != 1:
        raise SpecError(f"a token block must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise SpecError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= TOKEN_ID_LIMIT):
        # int64 serialization would make -1 and 2**64 - 1 (and their like) the same block
        raise SpecError(f"token ids must be in [0, 2**32), got [{arr.min()}, {arr.max()}]")
    return arr


def _token_bytes(tokens: Any) -> bytes:
    return _token_ids(tokens).astype("<i8", copy=False).tobytes()


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    out = bytearray(h.digest())
    out[0] &= ~_PRIVATE_BIT & 0xFF
    return bytes(out)


_ROOTS_KEPT = 4096  # root keys remembered (by packed namespace and salt; then forgotten)
_roots: dict[tuple[bytes, bytes | None], PageKey] = {}


def root_key(namespace: Any = None, salt: bytes | None = None) -> PageKey:
    """The parent key of a sequence's first block, derived from a namespace and a salt.

    ``namespace`` is anything msgpack can encode (a model id string, a tuple of model and adapter
    ids...). Different namespaces never share pages.

    ``salt``: a cache salt already checked (:func:`tierkv.tenant_names.check_salt`: bytes, or
    None). It is mixed into the root, so into every block key chained on it: two salts (or a
    salt and none) never share a page in any tier. ``None`` gives exactly the unsalted keys.
    """
    ns = msgpack.packb(namespace, use_bin_type=True)
    root = _roots.get((ns, salt))  # (every prompt asks: a few namespaces and salts, hashed once)
    if root is None:
        root = _digest(_DOMAIN, ns) if salt is None else _digest(_DOMAIN, ns, _SALT, salt)
        if len(_roots) >= _ROOTS_KEPT:
            _roots.clear()
        _roots[ns, salt] = root
    return root


def block_key(parent: PageKey, tokens: Any, extra: Any = None) -> PageKey:
    """The content key of one full block, chained on its parent's key.

    Raises:
        SpecError: the parent is not a 16-byte key, or the tokens are not 1-D integers.
    """
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise SpecError(f"parent key must be {KEY_BYTES} bytes, got {parent!r}")
    extra_b = b"" if extra is None else msgpack.packb(extra, use_bin_type=True)
    return _digest(parent, _token_bytes(tokens), extra_b)


def prefix_keys(
    tokens: Sequence[int] | Any,
    page_tokens: int,
    namespace: Any = None,
    extras: Iterable[Any] | None = None,
    *,
    salt: bytes | str | None = None,
) -> list[PageKey]:
    """Content keys of every *full* block of ``tokens`` (a trailing partial block gets none).

    Args:
        tokens: the token ids of a prompt (list, numpy array or 1-D tensor).
        page_tokens: tokens per block.
        namespace: see :func:`root_key`.
        extras: optional per-block extra keys (one item per full block).
        salt: a cache salt (str or bytes, checked by
            :func:`tierkv.tenant_names.check_salt`; see :func:`root_key`).
    """
    root = root_key(namespace, check_salt(salt))
    _check_page_tokens(page_tokens)
    arr = _token_ids(tokens)
    n_full = len(arr) // page_tokens
    if extras is None:
        return chain_keys(root, arr, page_tokens)
    extra_list = list(extras)
    if len(extra_list) < n_full:
        raise SpecError(f"{len(extra_list)} extra keys for {n_full} full blocks")
    keys: list[PageKey] = []
    parent = root
    for i in range(n_full):
        parent = block_key(parent, arr[i * page_tokens : (i + 1) * page_tokens], extra_list[i])
        keys.append(parent)
    return keys


def chain_keys(parent: PageKey, tokens: npt.NDArray[Any], page_tokens: int) -> list[PageKey]:
    """Content keys of the full blocks of ``tokens`` chained on ``parent``, without extras:
    the keys :func:`block_key` gives block by block, at ~1.2 us a block (one buffer for all
    the token bytes, a copied hash state per block).

    ``tokens`` must be checked already (1-D integers in ``[0, 2**32)``; see
    :func:`tierkv.validate.token_array`). Raises SpecError for a bad parent or page size.
    """
    if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
        raise SpecError(f"parent key must be {KEY_BYTES} bytes, got {parent!r}")
    _check_page_tokens(page_tokens)
    n = len(tokens) // page_tokens
    step = page_tokens * 8
    data = memoryview(np.ascontiguousarray(tokens[: n * page_tokens], dtype="<i8").tobytes())
    base = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
    block_len = step.to_bytes(8, "little")
    keys: list[PageKey] = []
    for i in range(n):  # the same byte stream as _digest(parent, token bytes, b"")
        h = base.copy()
        h.update(_KEY_LEN + parent + block_len)
        h.update(data[i * step : (i + 1) * step])
        h.update(_NO_EXTRA)
        d = h.digest()
        parent = bytes((d[0] & ~_PRIVATE_BIT & 0xFF,)) + d[1:]
        keys.append(parent)
    return keys


def unpublished_keys(
    namespace: Any,
    blocks: Sequence[PageKey],
    shared: Sequence[int],
    block_tokens: Callable[[int], Any],
    full_blocks: int,
    salt: bytes | None = None,
) -> Iterator[tuple[int, PageKey]]:
    """``(index, content key)`` of each of a live sequence's first ``full_blocks`` blocks that
    has no content key yet (``shared[index]`` false), in order, each chained on the content
    key of the block before it: the one that block has (``blocks[i]`` when ``shared[i]``) or
    the one computed here for it. The keys are :func:`block_key`'s, so the same as
    :func:`prefix_keys` gives for the same tokens. Lazy: a caller that stops early hashes no
    further block.

    ``block_tokens(i)``: the token ids of block ``i`` (an ``array('q')``, a list or a 1-D
    integer array). ``salt``: the sequence's checked salt (see :func:`root_key`).
    """
    parent = b""  # (the root: hashed only when block 0 is unpublished, as it seldom is)
    for i in range(min(len(shared), full_blocks)):
        if shared[i]:
            parent = blocks[i]
            continue
        parent = block_key(parent if i else root_key(namespace, salt), block_tokens(i))
        yield i, parent


def layer_suffix(layer: int) -> bytes:
    """The two bytes a page key adds to its block's key for ``layer``."""
    return layer.to_bytes(2, "little")


def page_key(block: PageKey, layer: int) -> bytes:
    """The key of one layer's page of a block."""
    return block + layer.to_bytes(2, "little")


def is_content(key: bytes) -> bool:
    """True for a content block's key or a page key of one (shareable, immutable pages: the only
    ones a remote tier stores or serves); False for a private one or a key too short."""
    return len(key) >= KEY_BYTES and not key[0] & _PRIVATE_BIT


def private_key(seq_id: str | bytes | int, block_index: int) -> PageKey:
    """The key of a live sequence's private (still-growing) block."""
    sid = seq_id if isinstance(seq_id, bytes) else str(seq_id).encode()
    out = bytearray(_digest(b"private", sid, block_index.to_bytes(8, "little")))
    out[0] |= _PRIVATE_BIT
    return bytes(out)


def key_kind(key: PageKey) -> KeyKind:
    """Whether ``key`` is a content key or a private key."""
    if len(key) != KEY_BYTES:
        raise SpecError(f"a page key is {KEY_BYTES} bytes, got {len(key)}")
    return KeyKind.PRIVATE if key[0] & _PRIVATE_BIT else KeyKind.CONTENT


def _check_page_tokens(page_tokens: object) -> None:
    """SpecError unless ``page_tokens`` is an int > 0 (1.5 was a TypeError of a slice)."""
    if isinstance(page_tokens, bool) or not isinstance(page_tokens, int | np.integer):
        raise SpecError(f"page_tokens must be a positive int, got {page_tokens!r}")
    if page_tokens <= 0:
        raise SpecError(f"page_tokens must be positive, got {page_tokens}")
