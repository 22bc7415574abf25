"""The KV page model: one layout per model.

A *page* holds the keys and values of ``page_tokens`` consecutive tokens for **one layer**.
The tokens of a *block* (the same ``page_tokens`` tokens) span ``num_layers`` pages that share
the block's content key. Inside a page, K comes first and V second, each laid out
heads-major with ``head_dim`` innermost, and the page is padded to a multiple of 128 bytes::

    page (one layer, one block of T = page_tokens tokens, H = num_kv_heads, D = head_dim)
    offset 0
    +-------------------------------------------------------------+
    | K[h=0][t=0][0..D) K[h=0][t=1][0..D) ... K[h=0][t=T-1][0..D) |  H*T*D*itemsize bytes
    | K[h=1][t=0][0..D) ...                                        |
    | ...                                  K[h=H-1][t=T-1][0..D)   |
    +-------------------------------------------------------------+  <- kv_bytes
    | V[h=0][t=0][0..D) ...                V[h=H-1][t=T-1][0..D)   |  H*T*D*itemsize bytes
    +-------------------------------------------------------------+  <- 2*kv_bytes
    | zero padding up to a multiple of 128 bytes                   |
    +-------------------------------------------------------------+  <- page_bytes

Viewed as a tensor, a page is ``[2, H, T, D]`` (``page_shape``), which is what attention reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.arguments import checked_init
from tierkv.errors import SpecError

ALIGN = 128
"""Every page starts and ends on a 128-byte boundary."""

_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype named by ``dtype`` (``"fp16"``, ``"bfloat16"``, a torch dtype...).

    Raises:
        SpecError: the name is unknown or the dtype is not a floating KV dtype.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise SpecError(f"unsupported KV dtype {dtype}; use one of {sorted(set(_DTYPES))}")
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise SpecError(f"unknown KV dtype {dtype!r}; use one of {sorted(set(_DTYPES))}")


def _align(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


MAX_PAGE_BYTES = 1 << 30
"""The largest page a spec may have (a real model's page is kilobytes to a few megabytes: 128
KV heads of 256 dims and 1,024 tokens in fp32 are 256 MiB). An engine of
``page_tokens=10**9`` made 4 GB pages whose first append was killed by the kernel."""


@checked_init
@dataclass(frozen=True, slots=True)
class KVSpec:
    """The KV layout of one model: what a page holds and how many bytes it takes.

    Args:
        num_layers: transformer layers (one page per layer per token block).
        num_kv_heads: KV heads per layer (after grouped-query sharing).
        head_dim: elements per head.
        dtype: element type of K and V (``torch.float16``, ``"bf16"``...).
        page_tokens: tokens per page (the block size of the prefix hashes).

    Raises:
        SpecError: a non-positive or non-integer size, or an unsupported dtype.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    page_tokens: int = 16
    _itemsize: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_tokens"):
            value: Any = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise SpecError(f"KVSpec.{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        object.__setattr__(self, "_itemsize", torch.empty((), dtype=self.dtype).element_size())
        if self.page_bytes > MAX_PAGE_BYTES:  # (page_tokens=10**9: 4 GB pages, then the OOM killer)
            raise SpecError(
                f"KVSpec: a page of {self.page_bytes} bytes (one layer's K and V of "
                f"{self.page_tokens} tokens) is over {MAX_PAGE_BYTES}: give fewer page_tokens"
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self._itemsize

    @property
    def page_shape(self) -> tuple[int, int, int, int]:
        """Shape of a page viewed as a tensor: ``(2, num_kv_heads, page_tokens, head_dim)``."""
        return (2, self.num_kv_heads, self.page_tokens, self.head_dim)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the K half (or the V half) of a page, unpadded."""
        return self.num_kv_heads * self.page_tokens * self.head_dim * self._itemsize

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (one layer, one block), K and V, padded to 128 bytes."""
        return _align(2 * self.kv_bytes)

    @property
    def page_elems(self) -> int:
        """Elements of K and V in one page (without padding)."""
        return 2 * self.num_kv_heads * self.page_tokens * self.head_dim

    @property
    def block_bytes(self) -> int:
        """Bytes of one token block across all layers."""
        return self.page_bytes * self.num_layers

    @property
    def bytes_per_token(self) -> int:
        """Unpadded K+V bytes of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self._itemsize

    def blocks_for(self, seq_len: int) -> int:
        """Token blocks needed for ``seq_len`` tokens (the last one may be partial)."""
        if seq_len < 0:
            raise SpecError(f"sequence length must be >= 0, got {seq_len}")
        return math.ceil(seq_len / self.page_tokens)

    def pages_for(self, seq_len: int) -> int:
        """Pages (all layers) needed for ``seq_len`` tokens."""
        return self.blocks_for(seq_len) * self.num_layers

    def bytes_for(self, seq_len: int) -> int:
        """Page bytes (all layers, padded) needed for ``seq_len`` tokens."""
        return self.pages_for(seq_len) * self.page_bytes

    def to_dict(self) -> dict[str, Any]:
        """A JSON/msgpack-friendly description, the inverse of :meth:`from_dict`."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "page_tokens": self.page_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVSpec:
        """Build a spec from :meth:`to_dict` output. Raises SpecError on bad fields."""
        try:
            return cls(
                num_layers=d["num_layers"],
                num_kv_heads=d["num_kv_heads"],
                head_dim=d["head_dim"],
                dtype=d["dtype"],
                page_tokens=d["page_tokens"],
            )
        except KeyError as exc:
            raise SpecError(f"KVSpec field missing: {exc}") from exc
