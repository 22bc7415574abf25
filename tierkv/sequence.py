"""A live sequence: its tokens, its blocks' keys and how much KV each layer holds.

A sequence's block ``b`` is named by a *content* key once it is full and its tokens are known
(shareable with every request that has the same prefix), and by a *private* key while it still
grows. The page of block ``b`` in layer ``l`` is ``block_key + l`` (two little-endian bytes)::

    page key (18 bytes) = block key (16 bytes) | layer (2 bytes)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tierkv.keys import PageKey, block_key, private_key, root_key


def page_key(block: PageKey, layer: int) -> bytes:
    """The key of one layer's page of a block."""
    return block + layer.to_bytes(2, "little")


@dataclass(slots=True)
class SequenceState:
    """Book-keeping of one live sequence inside a store."""

    seq_id: str
    num_layers: int
    page_tokens: int
    namespace: object
    tokens: list[int] = field(default_factory=list)
    blocks: list[PageKey] = field(default_factory=list)  # one key per block with KV
    shared: list[bool] = field(default_factory=list)  # block key is a content key
    kv_len: list[int] = field(default_factory=list)  # tokens of KV held, per layer
    cached_tokens: int = 0
    incarnation: int = 0  # a store-wide count: a reused id never meets its old private pages

    def __post_init__(self) -> None:
        if not self.kv_len:
            self.kv_len = [0] * self.num_layers

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
        if len(self.tokens) < (index + 1) * t:
            return None
        parent = root_key(self.namespace) if index == 0 else self.blocks[index - 1]
        if index > 0 and not self.shared[index - 1]:
            return None  # a private parent: the chain is not shareable
        return block_key(parent, self.tokens[index * t : (index + 1) * t])
