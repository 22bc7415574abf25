"""Per-page key summaries and top-k page selection at decode (Quest's criterion).

For every page and KV head the table keeps the per-channel minimum, maximum and mean of the
page's keys. A query ``q`` bounds its score against any key of the page from above by
``sum_d max(q_d * kmin_d, q_d * kmax_d) = kmax . relu(q) + kmin . min(q, 0)``; with a
``mean_weight`` ``w`` the estimate moves towards the page's mean key,
``(1 - w) * bound + w * q . kmean`` (the bound alone ranks a page with one outlying key per
channel as high as a page of such keys). Pages are whole (every head of a page loads together),
so each query head's estimates are turned into weights over the pages by a softmax
(``scale * estimate``) and the weights summed over heads: every head
has one vote of equal size, spread over the pages it may attend. The top ``k`` pages by that
score are attended, always with the first page (the attention sink) and the ``recent`` last
pages; when those cover every page the selection is every page and attention is exact.

:class:`KeySummaries` is the one owner of the summaries: the store's table
(``KVStore.summaries``) keyed by page key, a ``[3, Hkv, D]`` tensor (min, max, mean) per page,
kept in host memory beside the page table whatever tier holds the page. It follows the pages'
renames (a published block's private key becomes its content key) and serves every sequence
that shares a page; a page appended to only partly is summarised over its tokens so far and
widened by later appends (the mean weighted by the tokens on each side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tierkv import validate
from tierkv.errors import InvalidInputError, InvalidTypeError, SpecError

__all__ = ["KeySummaries", "PageBounds", "page_bounds", "page_scores", "select_pages"]


@dataclass(frozen=True)
class PageBounds:
    """Of some keys of a sequence's layer: the first page they touch (``first``), and of each
    touched page over those keys the per-channel ``lo`` (min), ``hi`` (max) and ``sums``
    (``[pages, Hkv, D]`` float32 each) and how many of them fall in it (``counts``
    ``[pages]``)."""

    first: int
    lo: torch.Tensor
    hi: torch.Tensor
    sums: torch.Tensor
    counts: torch.Tensor


def page_bounds(k: torch.Tensor, start: int, page_tokens: int) -> PageBounds:
    """Of keys ``k`` ``[Hkv, n, D]`` of tokens ``start...``: the first page they touch and the
    min, max, sum and count of each touched page over those keys. Raises InvalidTypeError /
    SpecError for keys that are no ``[Hkv, n, D]`` tensor of at least one token,
    InvalidInputError for a negative ``start`` or a ``page_tokens`` below 1 (a 2-D ``k`` was
    a ValueError, ``page_tokens`` 0 a ZeroDivisionError, no keys a RuntimeError)."""
    if not isinstance(k, torch.Tensor):
        raise InvalidTypeError(f"k: expected a torch.Tensor, got {type(k).__name__}")
    if k.dim() != 3 or k.shape[1] < 1:
        raise SpecError(f"k: expected [Hkv, n >= 1, D] keys, got {list(k.shape)}")
    validate.count("start", start, 0)
    validate.count("page_tokens", page_tokens, 1)
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
    lo, hi = pages.amin(dim=2).transpose(0, 1), pages.amax(dim=2).transpose(0, 1)
    padded[:, :pad] = 0.0  # the same buffer zero-padded: sums over these keys only
    padded[:, pad + n :] = 0.0
    sums = pages.sum(dim=2).transpose(0, 1)
    ends = torch.arange(1, span + 1) * t
    counts = ends.clamp(max=pad + n) - (ends - t).clamp(min=pad)
    return PageBounds(first, lo, hi, sums, counts)


def page_scores(
    q: torch.Tensor, table: torch.Tensor, scale: float, mean_weight: float = 0.0
) -> torch.Tensor:
    """Page scores ``[P]`` of a decode query ``q`` ``[Hq, D]`` against summaries ``table``
    ``[P, 3, Hkv, D]`` (min, max, mean; module docstring): each query head's softmax over the
    pages of ``scale * ((1 - mean_weight) * bound + mean_weight * q . mean)``, summed over the
    heads (``mean_weight`` 0: Quest's bound alone, and a ``[P, 2, Hkv, D]`` table of min and
    max serves). Unknown (NaN) pages score ``inf``. Raises SpecError for shapes that do not fit
    or a table without means for a ``mean_weight`` above 0."""
    rows = 2 if not mean_weight else 3
    if (
        q.dim() != 2
        or table.dim() != 4
        or not rows <= table.shape[1] <= 3
        or q.shape[1] != table.shape[3]
    ):
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
    if mean_weight:  # halfway towards the page's mean key: a tighter estimate of its mass
        mean = torch.matmul(qg, table[:, 2].transpose(0, 1).transpose(1, 2))
        bound = bound.mul_(1.0 - mean_weight).add_(mean, alpha=mean_weight)
    bound = bound.mul_(scale).masked_fill_(unknown, float("-inf"))
    scores = torch.softmax(bound, dim=-1).nan_to_num_(0.0).sum(dim=(0, 1))
    return scores.masked_fill_(unknown, float("inf"))


def select_pages(scores: torch.Tensor, topk: int, sink: int = 1, recent: int = 2) -> list[int]:
    """Pages to attend, ascending: the first ``sink``, the last ``recent`` and the ``topk``
    best scored of the others (``scores`` ``[P]``). Every page when they cover all.

    Raises InvalidInputError for ``topk < 1`` or negative ``sink`` / ``recent``
    (InvalidTypeError: not ints), SpecError for ``scores`` that are no 1-D tensor.
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise InvalidInputError(f"topk must be an int >= 1, got {topk!r}")
    validate.count("sink", sink, 0)  # (a float was a TypeError of a slice, a bool taken)
    validate.count("recent", recent, 0)
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        shape = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
        raise SpecError(f"scores: expected a 1-D tensor, one score a page, got {shape}")
    p = scores.shape[0]
    lo, hi = min(sink, p), max(min(sink, p), p - recent)
    if hi - lo <= topk:
        return list(range(p))
    middle = torch.topk(scores[lo:hi], topk).indices.add_(lo).tolist()
    return sorted([*range(lo), *middle, *range(hi, p)])


class KeySummaries:
    """Min, max and mean of K per page key and KV head (``[3, Hkv, D]`` float32 each): the
    store's one table of page summaries (``KVStore.summaries``).

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

    def fold(self, keys: Sequence[bytes], b: PageBounds, before: int) -> None:
        """Fold per-page bounds ``b`` (:func:`page_bounds`) into the pages ``keys``: every page
        but the first starts fresh here (its summary is set); the first is set when ``before``
        (its tokens ahead of these) is 0, else widened, its mean weighted by the counts
        (unknown when the table never saw it). Raises SpecError for shapes that do not fit."""
        want = (len(keys), self.num_kv_heads, self.head_dim)
        if any(tuple(x.shape) != want for x in (b.lo, b.hi, b.sums)) or b.counts.shape != (
            len(keys),
        ):
            raise SpecError(f"bounds must be {list(want)}, got {list(b.lo.shape)}")
        rows = self._rows
        for i, key in enumerate(keys):
            n = float(b.counts[i])
            if i == 0 and before:
                got = rows.get(key)
                if got is None:
                    rows[key] = torch.full((3, *want[1:]), float("nan"))
                else:
                    torch.minimum(got[0], b.lo[i], out=got[0])
                    torch.maximum(got[1], b.hi[i], out=got[1])
                    got[2].mul_(before).add_(b.sums[i]).div_(before + n)
                continue
            rows[key] = torch.stack([b.lo[i], b.hi[i], b.sums[i] / n])

    def append(self, pages: Sequence[bytes], k: torch.Tensor, start: int, page_tokens: int) -> None:
        """Fold in keys ``k`` ``[Hkv, n, D]`` of tokens ``start...`` of a sequence's layer whose
        page keys are ``pages`` (all of them, in order, these tokens' included)."""
        if k.shape[1] == 0:
            return
        b = page_bounds(k, start, page_tokens)
        self.fold(pages[b.first : b.first + b.lo.shape[0]], b, start % page_tokens)

    def table(self, keys: Sequence[bytes]) -> torch.Tensor:
        """``[len(keys), 3, Hkv, D]``: the pages' summaries (min, max, mean) in order, NaN
        where unknown."""
        rows = self._rows
        unknown = None
        got = []
        for key in keys:
            row = rows.get(key)
            if row is None:
                if unknown is None:
                    unknown = torch.full((3, self.num_kv_heads, self.head_dim), float("nan"))
                row = unknown
            got.append(row)
        if not got:
            return torch.empty((0, 3, self.num_kv_heads, self.head_dim))
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
        return len(self._rows) * 3 * self.num_kv_heads * self.head_dim * 4
