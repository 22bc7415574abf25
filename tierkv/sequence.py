"""A live sequence: its tokens, its blocks' keys and how much KV each layer holds.

A sequence's block ``b`` is named by a *content* key once it is full and its tokens are known
(shareable with every request that has the same prefix), and by a *private* key while it still
grows; its page in layer ``l`` by :func:`tierkv.keys.page_key`. Keys are made in
:mod:`tierkv.keys` only; a sequence keeps them.
"""

from __future__ import annotations

import functools
import struct
from array import array
from collections.abc import Iterable, Iterator, Sequence

from tierkv.keys import (
    KEY_BYTES,
    PageKey,
    layer_suffix,
    page_key,
    private_key,
    unpublished_keys,
)

__all__ = ["SequenceState", "page_key"]  # page_key: kept importable from here

_LEN = struct.Struct("q")  # a layer's KV length in the flat buffer


@functools.lru_cache(maxsize=64)
def _lengths(num_layers: int) -> struct.Struct:
    """The struct of every layer's KV length (one per layer count, shared: a struct is a
    tracked object, so no sequence holds one)."""
    return struct.Struct(f"{num_layers}q")


class SequenceState:
    """Book-keeping of one live sequence inside a store.

    Everything a sequence holds is kept in flat byte buffers the cyclic garbage collector never
    tracks: the token ids (8 bytes each, native int64), the blocks' 16-byte keys end to end, a
    byte per block saying whether its key is a content key, and the KV length of each layer.
    The state object itself is the one tracked object a sequence adds: 10,000 idle sequences
    add 10,000 objects to a full collector pass, not 50,000 (lists and arrays are tracked), and
    a 1,000-token prompt adds no reference per token.

    Read through :attr:`tokens` / :attr:`token_ids`, :attr:`blocks`, :attr:`kv_len` (new
    lists or arrays: changing them changes nothing) and :meth:`block`; change through
    :meth:`add_tokens`, :meth:`append_block`, :meth:`set_block`, :meth:`set_blocks` and
    :meth:`set_kv_len`. :attr:`shared` is the flag buffer itself (a ``bytearray``: ``all()``,
    ``sum()`` and indexing work as on a list of bools).
    """

    __slots__ = (
        "_keys",
        "_kv",
        "_tok",
        "cached_tokens",
        "incarnation",
        "namespace",
        "num_layers",
        "page_tokens",
        "salt",
        "seq_id",
        "shared",
        "tenant",
    )

    def __init__(
        self,
        seq_id: str,
        num_layers: int,
        page_tokens: int,
        namespace: object,
        tokens: Iterable[int] = (),
        *,
        incarnation: int = 0,
        salt: bytes | None = None,
        tenant: int | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.num_layers = num_layers
        self.page_tokens = page_tokens
        self.namespace = namespace
        ids = tokens if isinstance(tokens, array) and tokens.typecode == "q" else array("q", tokens)
        self._tok = bytearray(ids.tobytes())  # native int64 token ids
        self._keys = bytearray()  # one 16-byte key per block with KV, end to end
        self.shared = bytearray()  # per block: 1 when its key is a content key
        self._kv = bytearray(_LEN.size * num_layers)  # tokens of KV held, per layer
        self.cached_tokens = 0
        # a store-wide count: a reused id never meets its old private pages
        self.incarnation = incarnation
        self.salt = salt  # the checked cache salt its content keys are chained on (or None)
        self.tenant = tenant  # the store's index of the tenant charged for its pages, or None

    def __repr__(self) -> str:
        return (
            f"SequenceState({self.seq_id!r}, tokens={self.num_tokens}, "
            f"blocks={self.num_blocks}, kv_len={self.kv_len})"
        )

    # -- tokens ----------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The token ids so far, as a new list."""
        return self.token_ids.tolist()

    @property
    def token_ids(self) -> array[int]:
        """The token ids so far, as a new ``array('q')``."""
        out: array[int] = array("q")
        out.frombytes(self._tok)
        return out

    def token_slice(self, start: int, stop: int) -> array[int]:
        """Token ids ``start:stop`` as a new ``array('q')`` (bounds as a slice's)."""
        out: array[int] = array("q")
        n = self.num_tokens
        out.frombytes(self._tok[8 * min(start, n) : 8 * min(stop, n)])
        return out

    @property
    def num_tokens(self) -> int:
        """How many token ids the sequence has (its prompt and the tokens added since)."""
        return len(self._tok) >> 3

    def add_tokens(self, ids: Iterable[int]) -> None:
        """Append checked token ids (see :func:`tierkv.validate.token_ids`)."""
        self._tok += array("q", ids).tobytes()

    # -- blocks ----------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """How many blocks have a key (blocks with KV)."""
        return len(self.shared)

    def block(self, index: int) -> PageKey:
        """The key of block ``index``. Raises IndexError past the last block."""
        if not 0 <= index < len(self.shared):
            raise IndexError(f"block {index} of {len(self.shared)}")
        return bytes(self._keys[KEY_BYTES * index : KEY_BYTES * (index + 1)])

    @property
    def blocks(self) -> list[PageKey]:
        """The blocks' keys, as a new list."""
        k = bytes(self._keys)  # one copy; its slices are the keys
        return [k[i : i + KEY_BYTES] for i in range(0, len(k), KEY_BYTES)]

    def append_block(self, key: PageKey, shared: bool) -> None:
        """Give the next block a key (a content key when ``shared``)."""
        self._keys += key
        self.shared.append(1 if shared else 0)

    def set_block(self, index: int, key: PageKey, shared: bool = True) -> None:
        """Rename block ``index`` (its private key -> its content key, when ``shared``)."""
        self._keys[KEY_BYTES * index : KEY_BYTES * (index + 1)] = key
        self.shared[index] = 1 if shared else 0

    def set_blocks(self, keys: Sequence[PageKey], shared: bool) -> None:
        """Replace every block key (all content keys when ``shared``)."""
        self._keys = bytearray(b"".join(keys))
        self.shared = bytearray([1 if shared else 0]) * len(keys)

    # -- KV lengths ------------------------------------------------------------------------
    @property
    def kv_len(self) -> list[int]:
        """Tokens of KV held, per layer (a new list)."""
        return list(_lengths(self.num_layers).unpack(self._kv))

    def kv_len_of(self, layer: int) -> int:
        """Tokens of KV ``layer`` holds."""
        return int(_LEN.unpack_from(self._kv, _LEN.size * layer)[0])

    def set_kv_len(self, layer: int, n: int) -> None:
        """``layer`` now holds KV of ``n`` tokens."""
        _LEN.pack_into(self._kv, _LEN.size * layer, n)

    def set_all_kv_len(self, n: int) -> None:
        """Every layer now holds KV of ``n`` tokens."""
        self._kv = bytearray(_LEN.pack(n)) * self.num_layers

    @property
    def length(self) -> int:
        """Tokens with KV in every layer."""
        return min(_lengths(self.num_layers).unpack(self._kv))

    def pages(self, layer: int) -> list[bytes]:
        """Page keys of every block of ``layer`` that holds KV."""
        n = -(-self.kv_len_of(layer) // self.page_tokens)
        k, suffix = bytes(self._keys[: n * KEY_BYTES]), layer_suffix(layer)
        return [k[i : i + KEY_BYTES] + suffix for i in range(0, n * KEY_BYTES, KEY_BYTES)]

    def all_pages(self, layers: Sequence[int] | None = None) -> list[bytes]:
        """Page keys of the given layers (all by default)."""
        ls = range(self.num_layers) if layers is None else layers
        return [k for layer in ls for k in self.pages(layer)]

    def private_block(self, index: int) -> PageKey:
        """The private key of block ``index`` (of this incarnation of the id)."""
        return private_key(f"{self.seq_id}\x00{self.incarnation}", index)

    def unpublished(self) -> Iterator[tuple[int, PageKey]]:
        """``(index, content key)`` of the full blocks (their tokens known, their KV in every
        layer) still named by a private key, in order, each chained on the content key of the
        block before it, published or not (:func:`tierkv.keys.unpublished_keys`; lazy)."""
        t = self.page_tokens
        return unpublished_keys(
            self.namespace,
            self.blocks,
            self.shared,
            lambda i: self.token_slice(i * t, (i + 1) * t),
            min(self.length, self.num_tokens) // t,
            self.salt,
        )
