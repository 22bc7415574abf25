"""Per-page key summaries and top-k page selection at decode (Quest's criterion).

For every page and KV head the table keeps the per-channel minimum and maximum of the page's
keys. A query ``q`` bounds its score against any key of the page from above by
``sum_d max(q_d * kmin_d, q_d * kmax_d) = kmax . relu(q) + kmin . min(q, 0)``. Pages are whole
(every head of a page loads together), so each query head's bounds are turned into weights
over the pages by a softmax (``scale * bound``) and the weights summed over heads: every head
has one vote of equal size, spread over the pages it may attend. The top ``k`` pages by that
score are attended, always with the first page (the attention sink) and the ``recent`` last
pages; when those cover every page the selection is every page and attention is exact.

:class:`PageSummaries` is the one owner of the summaries: a side table keyed by
``(sequence, layer)``, each a ``[P, 2, Hkv, D]`` tensor (min then max) growing with the
sequence, kept in host memory beside the pages whatever tier holds them. A page appended
to only partly is summarised over its tokens so far and widened by later appends.
"""

from __future__ import annotations

import torch

from tierkv import validate
from tierkv.errors import InvalidInputError, SequenceError, SpecError

__all__ = ["PageSummaries", "page_scores", "select_pages"]


class PageSummaries:
    """Min/max of K per page and KV head, by ``(sequence id, layer)`` (module docstring).

    Args:
        page_tokens: tokens per page.
        num_kv_heads, head_dim: the KV layout.
    """

    def __init__(self, page_tokens: int, num_kv_heads: int, head_dim: int) -> None:
        self.page_tokens = validate.count("page_tokens", page_tokens, 1)
        self.num_kv_heads = validate.count("num_kv_heads", num_kv_heads, 1)
        self.head_dim = validate.count("head_dim", head_dim, 1)
        self._rows: dict[tuple[str, int], torch.Tensor] = {}
        self._tokens: dict[tuple[str, int], int] = {}

    def tokens(self, seq_id: str, layer: int) -> int:
        """Tokens summarised for ``(seq_id, layer)`` (0 when none)."""
        return self._tokens.get((seq_id, layer), 0)

    def pages(self, seq_id: str, layer: int) -> int:
        """Pages summarised for ``(seq_id, layer)``."""
        return -(-self.tokens(seq_id, layer) // self.page_tokens)

    def append(self, seq_id: str, layer: int, k: torch.Tensor, start: int | None = None) -> None:
        """Fold in the keys ``k`` ``[Hkv, n, D]`` of the sequence's tokens from ``start`` on
        (default: after the last summarised). Tokens skipped (a reused prefix the table never
        saw) leave their pages unknown (NaN): :func:`page_scores` ranks them first.

        Raises SpecError for a shape that is not the layout's, InvalidInputError for a
        ``start`` before the tokens already summarised.
        """
        if k.dim() != 3 or (k.shape[0], k.shape[2]) != (self.num_kv_heads, self.head_dim):
            raise SpecError(
                f"keys must be [{self.num_kv_heads}, n, {self.head_dim}], got {list(k.shape)}"
            )
        n = k.shape[1]
        if n == 0:
            return
        key = (seq_id, layer)
        have = self._tokens.get(key, 0)
        start = have if start is None else start
        if start < have:
            raise InvalidInputError(f"keys from token {start}: {have} are summarised already")
        end = start + n
        t = self.page_tokens
        need = -(-end // t)
        rows = self._rows.get(key)
        if rows is None or rows.shape[0] < need:
            rows = self._rows[key] = self._grow(rows, need)
        if start > have:  # a gap: its pages are unknown for good
            rows[have // t : -(-start // t)] = float("nan")
        k = k.detach().to("cpu", torch.float32)
        first = start // t
        pad = start - first * t  # tokens of the first page before this append
        span = need - first
        padded = torch.empty((self.num_kv_heads, span * t, self.head_dim))
        # pad with the keys' own first token: min/max unchanged, one reduction for all pages
        padded[:, :pad] = k[:, :1]
        padded[:, pad : pad + n] = k
        padded[:, pad + n :] = k[:, -1:]
        pages = padded.view(self.num_kv_heads, span, t, self.head_dim)
        lo, hi = pages.amin(dim=2).transpose(0, 1), pages.amax(dim=2).transpose(0, 1)
        torch.minimum(rows[first:need, 0], lo, out=rows[first:need, 0])
        torch.maximum(rows[first:need, 1], hi, out=rows[first:need, 1])
        self._tokens[key] = end

    def _grow(self, rows: torch.Tensor | None, need: int) -> torch.Tensor:
        grown = torch.empty((need, 2, self.num_kv_heads, self.head_dim))
        grown[:, 0].fill_(float("inf"))
        grown[:, 1].fill_(float("-inf"))
        if rows is not None:
            grown[: rows.shape[0]] = rows
        return grown

    def table(self, seq_id: str, layer: int) -> torch.Tensor:
        """The ``[P, 2, Hkv, D]`` float32 summaries (min, max) of ``(seq_id, layer)``.

        Raises SequenceError when nothing was summarised for it."""
        got = self._rows.get((seq_id, layer))
        if got is None:
            raise SequenceError(f"no page summaries for sequence {seq_id!r} layer {layer}")
        return got

    def drop(self, seq_id: str) -> None:
        """Forget every layer of ``seq_id`` (its pages were released)."""
        for key in [key for key in self._rows if key[0] == seq_id]:
            del self._rows[key]
            del self._tokens[key]

    def nbytes(self) -> int:
        """Bytes the table holds."""
        return sum(t.numel() * t.element_size() for t in self._rows.values())


def page_scores(q: torch.Tensor, table: torch.Tensor, scale: float) -> torch.Tensor:
    """Page scores ``[P]`` of a decode query ``q`` ``[Hq, D]`` against summaries ``table``
    ``[P, 2, Hkv, D]`` (module docstring). Raises SpecError for shapes that do not fit."""
    if q.dim() != 2 or table.dim() != 4 or table.shape[1] != 2 or q.shape[1] != table.shape[3]:
        raise SpecError(f"q {list(q.shape)} and summaries {list(table.shape)} do not fit")
    hq, d = q.shape
    p, _, hkv, _ = table.shape
    if hq % hkv:
        raise SpecError(f"{hq} query heads cannot share {hkv} KV heads")
    qg = q.float().view(hkv, hq // hkv, d)
    unknown = table.flatten(1).isnan().any(dim=1)  # [P]
    table = torch.where(unknown.view(p, 1, 1, 1), 0.0, table)
    lo, hi = table[:, 0].transpose(0, 1), table[:, 1].transpose(0, 1)  # [Hkv, P, D]
    # upper bound of q . k over the page, [Hkv, g, P]
    bound = torch.matmul(qg.clamp(min=0), hi.transpose(1, 2)) + torch.matmul(
        qg.clamp(max=0), lo.transpose(1, 2)
    )
    bound = bound.mul_(scale).masked_fill_(unknown, float("-inf"))
    scores = torch.softmax(bound, dim=-1).nan_to_num_(0.0).sum(dim=(0, 1))
    return scores.masked_fill_(unknown, float("inf"))


def select_pages(scores: torch.Tensor, topk: int, sink: int = 1, recent: int = 2) -> list[int]:
    """Pages to attend, ascending: the first ``sink``, the last ``recent`` and the ``topk``
    best scored of the others (``scores`` ``[P]``). Every page when they cover all.

    Raises InvalidInputError for ``topk < 1`` or negative ``sink`` / ``recent``.
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise InvalidInputError(f"topk must be an int >= 1, got {topk!r}")
    if sink < 0 or recent < 0:
        raise InvalidInputError(f"sink and recent must be >= 0, got {sink}, {recent}")
    p = scores.shape[0]
    lo, hi = min(sink, p), max(min(sink, p), p - recent)
    if hi - lo <= topk:
        return list(range(p))
    middle = torch.topk(scores[lo:hi], topk).indices.add_(lo).tolist()
    return sorted([*range(lo), *middle, *range(hi, p)])
