"""A live sequence: its tokens, its blocks' keys and how much KV each layer holds.

A sequence's block ``b`` is named by a *content* key once it is full and its tokens are known
(shareable with every request that has the same prefix), and by a *private* key while it still
grows. The page of block ``b`` in layer ``l`` is ``block_key + l`` (two little-endian bytes)::

    page key (18 bytes) = block key (16 bytes) | layer (2 bytes)
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

from tierkv.keys import PageKey, block_key, private_key, root_key


def page_key(block: PageKey, layer: int) -> bytes:
    """The key of one layer's page of a block."""
    return block + layer.to_bytes(2, "little")


class SequenceState:
    """Book-keeping of one live sequence inside a store.

    The token ids are kept in a flat ``array('q')`` (8 bytes each, one object with one
    reference) rather than a list of ints (40 bytes each, every one a reference a full collector
    pass visits): 10,000 idle sequences of a 1,000-token prompt would otherwise add 10M
    references to every full pass. :attr:`tokens` gives them as a list.
    """

    __slots__ = (
        "blocks",
        "cached_tokens",
        "incarnation",
        "kv_len",
        "namespace",
        "num_layers",
        "page_tokens",
        "seq_id",
        "shared",
        "token_ids",
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
    ) -> None:
        self.seq_id = seq_id
        self.num_layers = num_layers
        self.page_tokens = page_tokens
        self.namespace = namespace
        self.token_ids: array[int] = tokens if isinstance(tokens, array) else array("q", tokens)
        self.blocks: list[PageKey] = []  # one key per block with KV
        self.shared: list[bool] = []  # block key is a content key
        self.kv_len: list[int] = [0] * num_layers  # tokens of KV held, per layer
        self.cached_tokens = 0
        # a store-wide count: a reused id never meets its old private pages
        self.incarnation = incarnation

    def __repr__(self) -> str:
        return (
            f"SequenceState({self.seq_id!r}, tokens={len(self.token_ids)}, "
            f"blocks={len(self.blocks)}, kv_len={self.kv_len})"
        )

    @property
    def tokens(self) -> list[int]:
        """The token ids so far, as a new list."""
        return self.token_ids.tolist()

    @property
    def num_tokens(self) -> int:
        """How many token ids the sequence has (its prompt and the tokens added since)."""
        return len(self.token_ids)

    def add_tokens(self, ids: Iterable[int]) -> None:
        """Append checked token ids (see :func:`tierkv.validate.token_ids`)."""
        self.token_ids.extend(ids)

    @property
    def length(self) -> int:
        """Tokens with KV in every layer."""
        return min(self.kv_len)

    def pages(self, layer: int) -> list[bytes]:
        """Page keys of every block of ``layer`` that holds KV."""
        n = -(-self.kv_len[layer] // self.page_tokens)
        return [page_key(b, layer) for b in self.blocks[:n]]

    def all_pages(self, layers: range | list[int] | None = None) -> list[bytes]:
        """Page keys of the given layers (all by default)."""
        ls = range(self.num_layers) if layers is None else layers
        return [k for layer in ls for k in self.pages(layer)]

    def private_block(self, index: int) -> PageKey:
        """The private key of block ``index`` (of this incarnation of the id)."""
        return private_key(f"{self.seq_id}\x00{self.incarnation}", index)

    def content_key(self, index: int) -> PageKey | None:
        """The content key of block ``index`` once its tokens are known, else None."""
        t = self.page_tokens
        if len(self.token_ids) < (index + 1) * t:
            return None
        parent = root_key(self.namespace) if index == 0 else self.blocks[index - 1]
        if index > 0 and not self.shared[index - 1]:
            return None  # a private parent: the chain is not shareable
        return block_key(parent, self.token_ids[index * t : (index + 1) * t])
