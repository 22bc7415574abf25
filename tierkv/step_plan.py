"""The index math of a step (:mod:`tierkv.step`): device pages as rows, and per layer the rows
an append writes and the rows attention reads, as int64 tensors built with a few torch ops
(no Python per page or per token).

The device arena is ``[slots, 2, H, T, D]`` (a page per slot, K then V); seen as rows of ``D``
elements, the row of (slot, kv, head, token) is ``slot * R + (kv * H + head) * T + token``
where ``R`` is the rows one slot spans (its padding included)::

    slot s:  [K h0 t0..T-1][K h1 ...]...[V h0 t0..T-1]...[pad]     R rows
    rows of a sequence's K/V, in the order attention reads them: (kv, head, token)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tierkv.errors import SpecError
from tierkv.spec import KVSpec

__all__ = ["LayerRows", "arena_rows", "layer_rows"]


def arena_rows(pages: torch.Tensor, spec: KVSpec) -> tuple[torch.Tensor, int]:
    """The device pages ``[slots, 2, H, T, D]`` as a ``[rows, D]`` view, and the rows one slot
    spans. Raises SpecError when a slot is not a whole number of rows (a page size whose
    alignment padding is not a multiple of ``D`` elements)."""
    d = spec.head_dim
    stride = pages.stride(0)
    if stride % d or pages.stride(-1) != 1 or pages.stride(-2) != d:
        raise SpecError(
            f"the step path needs pages that are whole rows of head_dim={d} elements "
            f"(a slot spans {stride} elements): use store.lease()"
        )
    per_slot = stride // d
    flat = pages.as_strided((pages.shape[0] * per_slot, d), (d, 1), pages.storage_offset())
    return flat, per_slot


class LayerRows:
    """One layer's rows for the sequences of a step.

    ``read``: the rows of every sequence's K/V after the append, sequence by sequence, each
    ``(kv, head, token)``; ``sizes``: the rows of each sequence; ``k_rows(by_seq)`` /
    ``v_rows(by_seq)``: where the new tokens' K (V) go, for new KV laid out ``[B, H, n, D]``
    (``by_seq``) or ``[H, N, D]`` (the sequences' new tokens one after another)."""

    __slots__ = ("_head", "_kv_off", "_tok", "batch", "lengths", "n_new", "read", "sizes")

    def __init__(
        self,
        read: torch.Tensor,
        tok: torch.Tensor,
        lengths: list[int],
        n_new: list[int],
        spec: KVSpec,
    ) -> None:
        self.read = read
        self._tok = tok  # the row of (kv=0, head=0) of each new token, sequence after sequence
        self.lengths = lengths
        self.n_new = n_new
        self.batch = len(lengths)
        h, t = spec.num_kv_heads, spec.page_tokens
        self.sizes = [2 * h * s for s in lengths]
        self._head = torch.arange(h, dtype=torch.int64, device=tok.device) * t
        self._kv_off = h * t

    def k_rows(self, by_seq: bool) -> torch.Tensor:
        """Rows of the new tokens' K, in the order of the new KV's elements."""
        h = self._head
        if by_seq:  # [B, H, n, D]: (b, head, j)
            n = self.n_new[0] if self.n_new else 0
            return (self._tok.view(self.batch, 1, n) + h.view(1, -1, 1)).reshape(-1)
        return (h.view(-1, 1) + self._tok.view(1, -1)).reshape(-1)  # [H, N, D]: (head, j)

    def v_rows(self, by_seq: bool) -> torch.Tensor:
        """Rows of the new tokens' V (those of K, one K block further)."""
        return self.k_rows(by_seq) + self._kv_off


def layer_rows(
    slots: Sequence[Sequence[int]],
    starts: Sequence[int],
    n_new: Sequence[int],
    per_slot: int,
    spec: KVSpec,
    device: torch.device,
) -> LayerRows:
    """The rows of one layer: ``slots[b]``, the device slots of sequence ``b``'s pages in block
    order (its new pages included); ``starts[b]``, its KV length before the append;
    ``n_new[b]``, the tokens it appends. A few torch ops in all (one batch of them when every
    sequence has as many pages and tokens, else a few per sequence)."""
    h, t = spec.num_kv_heads, spec.page_tokens
    ends = [s + n for s, n in zip(starts, n_new)]
    inner = (
        torch.arange(2, dtype=torch.int64).view(2, 1, 1, 1) * (h * t)
        + torch.arange(h, dtype=torch.int64).view(1, h, 1, 1) * t
        + torch.arange(t, dtype=torch.int64).view(1, 1, 1, t)
    )  # [2, H, 1, T]: (kv, head, token in page)
    pages = [len(s) for s in slots]
    uniform = len(set(pages)) <= 1 and len(set(ends)) <= 1 and len(set(starts)) <= 1
    if uniform and slots:
        b, m, end, start = len(slots), pages[0], ends[0], starts[0]
        base = torch.tensor(slots, dtype=torch.int64).view(b, 1, 1, m, 1) * per_slot
        read = (base + inner).view(b, 2, h, m * t)[..., :end].reshape(-1)
        pos = torch.arange(start, end, dtype=torch.int64)
        tok = (base.view(b, m)[:, pos // t] + (pos % t)).reshape(-1)
    else:
        reads, toks = [], []
        for s, start, end in zip(slots, starts, ends):
            base = torch.tensor(list(s), dtype=torch.int64).view(1, 1, -1, 1) * per_slot
            reads.append((base + inner).view(2, h, -1)[..., :end].reshape(-1))
            pos = torch.arange(start, end, dtype=torch.int64)
            toks.append(base.view(-1)[pos // t] + pos % t)
        read = torch.cat(reads) if reads else torch.empty(0, dtype=torch.int64)
        tok = torch.cat(toks) if toks else torch.empty(0, dtype=torch.int64)
    if device.type != "cpu":
        read, tok = read.to(device, non_blocking=True), tok.to(device, non_blocking=True)
    return LayerRows(read, tok, ends, list(n_new), spec)
