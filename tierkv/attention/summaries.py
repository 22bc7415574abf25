"""Per-page key summaries and top-k page selection at decode (Quest's criterion).

For every page and KV head the table keeps the per-channel minimum and maximum of the page's
keys. A query ``q`` bounds its score against any key of the page from above by
``sum_d max(q_d * kmin_d, q_d * kmax_d) = kmax . relu(q) + kmin . min(q, 0)``. Pages are whole
(every head of a page loads together), so each query head's bounds are turned into weights
over the pages by a softmax (``scale * bound``) and the weights summed over heads: every head
has one vote of equal size, spread over the pages it may attend. The top ``k`` pages by that
score are attended, always with the first page (the attention sink) and the ``recent`` last
pages; when those cover every page the selection is every page and attention is exact.

:class:`KeySummaries` is the one owner of the summaries: the store's table
(``KVStore.summaries``) keyed by page key, a ``[2, Hkv, D]`` tensor (min then max) per page,
kept in host memory beside the page table whatever tier holds the page. It follows the pages'
renames (a published block's private key becomes its content key) and serves every sequence
that shares a page; a page appended to only partly is summarised over its tokens so far and
widened by later appends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tierkv import validate
from tierkv.errors import InvalidInputError, SpecError

__all__ = ["KeySummaries", "page_bounds", "page_scores", "select_pages"]


def page_bounds(
    k: torch.Tensor, start: int, page_tokens: int
) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Of keys ``k`` ``[Hkv, n, D]`` of tokens ``start...``: the first page they touch and the
    min and max of each touched page over those keys, ``[pages, Hkv, D]`` float32 each."""
    h, n, d = k.shape
    k = k.detach().to("cpu", torch.float32)
    t = page_tokens
    first = start // t
    pad = start - first * t  # tokens of the first page before these
    span = -(-(start + n) // t) - first
    padded = torch.empty((h, span * t, d))
    # pad with the keys' own first token: min/max unchanged, one reduction for all pages
    padded[:, :pad] = k[:, :1]
    padded[:, pad : pad + n] = k
    padded[:, pad + n :] = k[:, -1:]
    pages = padded.view(h, span, t, d)
    return first, pages.amin(dim=2).transpose(0, 1), pages.amax(dim=2).transpose(0, 1)


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


class KeySummaries:
    """Min/max of K per page key and KV head (``[2, Hkv, D]`` float32 each): the store's one
    table of page summaries (``KVStore.summaries``).

    Keyed by page key, a summary goes wherever its page goes (every tier: it lives in host
    memory beside the page table), follows the page's renames (the store calls
    :meth:`rename` from its rename listeners: a published block's private key becomes its
    content key) and serves every sequence that shares the page (a reused prefix is known, not
    re-summarised). A page's first append sets its summary, later appends widen it; a page
    first seen in mid-page (tokens before it never summarised) is *unknown* (NaN) for good.
    Entries of pages no tier holds any more are pruned once the table passes ``limit``
    entries (:meth:`prune`, from the store's step).

    Args:
        num_kv_heads, head_dim: the KV layout.
        limit: entries above which :meth:`due` says a prune is due (0: never).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, limit: int = 0) -> None:
        self.num_kv_heads = validate.count("num_kv_heads", num_kv_heads, 1)
        self.head_dim = validate.count("head_dim", head_dim, 1)
        self.limit = validate.count("limit", limit, 0)
        self._rows: dict[bytes, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def fold(
        self, keys: Sequence[bytes], lo: torch.Tensor, hi: torch.Tensor, first_fresh: bool
    ) -> None:
        """Fold per-page bounds ``lo``, ``hi`` ``[len(keys), Hkv, D]`` into the pages ``keys``:
        every page but the first starts fresh here (its summary is set); the first is set when
        ``first_fresh`` (the append began at its first token), else widened (unknown when the
        table never saw it). Raises SpecError for shapes that do not fit."""
        want = (len(keys), self.num_kv_heads, self.head_dim)
        if tuple(lo.shape) != want or tuple(hi.shape) != want:
            raise SpecError(f"bounds must be {list(want)}, got {list(lo.shape)} {list(hi.shape)}")
        rows = self._rows
        for i, key in enumerate(keys):
            got = rows.get(key)
            if i == 0 and not first_fresh:
                if got is None:
                    rows[key] = torch.full((2, *want[1:]), float("nan"))
                else:
                    torch.minimum(got[0], lo[i], out=got[0])
                    torch.maximum(got[1], hi[i], out=got[1])
                continue
            rows[key] = torch.stack([lo[i], hi[i]])

    def append(self, pages: Sequence[bytes], k: torch.Tensor, start: int, page_tokens: int) -> None:
        """Fold in keys ``k`` ``[Hkv, n, D]`` of tokens ``start...`` of a sequence's layer whose
        page keys are ``pages`` (all of them, in order, these tokens' included)."""
        if k.shape[1] == 0:
            return
        first, lo, hi = page_bounds(k, start, page_tokens)
        self.fold(pages[first : first + lo.shape[0]], lo, hi, start % page_tokens == 0)

    def table(self, keys: Sequence[bytes]) -> torch.Tensor:
        """``[len(keys), 2, Hkv, D]``: the pages' summaries in order, NaN where unknown."""
        rows = self._rows
        unknown = None
        got = []
        for key in keys:
            row = rows.get(key)
            if row is None:
                if unknown is None:
                    unknown = torch.full((2, self.num_kv_heads, self.head_dim), float("nan"))
                row = unknown
            got.append(row)
        if not got:
            return torch.empty((0, 2, self.num_kv_heads, self.head_dim))
        return torch.stack(got)

    def rename(self, old: Sequence[bytes], new: Sequence[bytes]) -> None:
        """Pages were renamed (pairwise): their summaries follow."""
        rows = self._rows
        for o, n in zip(old, new):
            row = rows.pop(o, None)
            if row is not None:
                rows[n] = row

    def due(self) -> bool:
        """Whether the table is past its ``limit`` (a prune is due)."""
        return 0 < self.limit < len(self._rows)

    def prune(self, held: Callable[[bytes], bool]) -> int:
        """Drop the summaries of pages for which ``held(key)`` is False (no tier holds them);
        returns how many went."""
        gone = [key for key in self._rows if not held(key)]
        for key in gone:
            del self._rows[key]
        return len(gone)

    def nbytes(self) -> int:
        """Bytes the table holds."""
        return len(self._rows) * 2 * self.num_kv_heads * self.head_dim * 4
