"""The index math of a step (:mod:`tierkv.step`): a group's pages by their names, device pages
as rows, and per layer the rows an append writes and the rows attention reads, as int64
tensors built with a few numpy ops (no Python per page or per token).

The device arena is ``[slots, 2, H, T, D]`` (a page per slot, K then V); seen as rows of ``D``
elements, the row of (slot, kv, head, token) is ``slot * R + (kv * H + head) * T + token``
where ``R`` is the rows one slot spans (its padding included)::

    slot s:  [K h0 t0..T-1][K h1 ...]...[V h0 t0..T-1]...[pad]     R rows
    rows of a sequence's K/V, in the order attention reads them: (kv, head, token)
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from tierkv.errors import SpecError
from tierkv.keys import layer_suffix
from tierkv.sequence import SequenceState, page_key
from tierkv.spec import KVSpec
from tierkv.tenants import Tenants

__all__ = ["GroupPages", "LayerRows", "arena_rows", "group_pages", "step_order", "written_keys"]


# a group's pages: those its layers read, those its appends open, and per layer (first key,
# first new key, KV lengths at entry, pages per sequence after the append, filled, written)
LayerPages = tuple[int, int, list[int], list[int], list[bytes], list[bytes]]
GroupPages = tuple[list[bytes], list[bytes], list[LayerPages]]


def written_keys(seqs: Sequence[SequenceState], tokens: Sequence[int], layer: int) -> list[bytes]:
    """The pages of ``layer`` that appending ``tokens[b]`` tokens to each ``seqs[b]`` writes
    (the partly filled page and the new ones), by their current names."""
    out: list[bytes] = []
    for seq, k in zip(seqs, tokens):
        if k:
            t = seq.page_tokens
            start = seq.kv_len_of(layer)
            blocks = range(start // t, -(-(start + k) // t))
            out += [page_key(seq.block(b), layer) for b in blocks]
    return out


def group_pages(
    seqs: Sequence[SequenceState],
    tokens: Sequence[int],
    layers: Sequence[int],
    t: int,
    tenants: Tenants | None = None,
) -> GroupPages:
    """A group of layers' pages by their current names (pages of ``t`` tokens): the pages its
    layers read, the new pages its appends open, and per layer where those start and what
    its append fills and writes. With ``tenants``, each sequence's tenant is charged for the
    new pages its append opens (its private pages: charging again is harmless).

    Each sequence's block keys are read once for the group's layers (a page's key is its
    block's and the layer's two bytes: :func:`tierkv.keys.page_key`)."""
    keys: list[bytes] = []
    new: list[bytes] = []
    plans: list[LayerPages] = []
    blocks = [seq.blocks for seq in seqs]
    for layer in layers:
        suffix = layer_suffix(layer)
        starts, counts, filled, written = [], [], [], []
        at, at_new = len(keys), len(new)
        for seq, k, bl in zip(seqs, tokens, blocks):
            start = seq.kv_len_of(layer)
            have, need = -(-start // t), -(-(start + k) // t)
            keys += [b + suffix for b in bl[:have]]
            if need > have:
                made = [b + suffix for b in bl[have:need]]
                if tenants is not None:
                    tenants.charge(made, seq.tenant, new=True)
                new += made
            first = start // t
            filled += [b + suffix for b in bl[first : (start + k) // t]]
            if k:
                written += [b + suffix for b in bl[first:need]]
            starts.append(start)
            counts.append(need)
        plans.append((at, at_new, starts, counts, filled, written))
    return keys, new, plans


def step_order(
    seqs: Sequence[SequenceState], tokens: Sequence[int], layers: Sequence[int], t: int
) -> list[bytes]:
    """A step's pages in the order it announces them (pages of ``t`` tokens): the pages its
    appends write (the partly filled and new ones), layer by layer, then the other pages its
    layers read, layer by layer; each sequence's block keys read once."""
    written: list[bytes] = []
    rest: list[bytes] = []
    blocks = [s.blocks for s in seqs]
    lengths = [s.kv_len for s in seqs]
    for layer in layers:
        suffix = layer_suffix(layer)
        for kv, k, bl in zip(lengths, tokens, blocks):
            start = kv[layer]
            if k:  # its pages before the first it writes, and those it writes
                first = start // t
                rest += [b + suffix for b in bl[:first]]
                written += [b + suffix for b in bl[first : -(-(start + k) // t)]]
            else:
                rest += [b + suffix for b in bl[: -(-start // t)]]
    if written:  # (a page is named once, among the written ones)
        wrote = set(written)
        rest = [k for k in rest if k not in wrote]
    return written + rest


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
    (``by_seq``) or ``[H, N, D]`` (the sequences' new tokens one after another).

    ``uniform``: every sequence has as many pages, tokens before and new tokens (a transformers
    batch always does); its K/V can then be gathered by whole pages (:meth:`page_index`).
    Everything is built on first use: a decode layer of a few sequences builds its few append
    rows in Python and gathers by pages, never building ``read``."""

    __slots__ = (
        "_device",
        "_k",
        "_padded",
        "_page_index",
        "_per_slot",
        "_read",
        "_read_np",
        "_slots",
        "_spec",
        "_starts",
        "_tok",
        "batch",
        "lengths",
        "n_new",
        "pages",
        "uniform",
    )

    def __init__(
        self,
        slots: Sequence[Sequence[int]],
        starts: Sequence[int],
        n_new: Sequence[int],
        per_slot: int,
        spec: KVSpec,
        device: torch.device,
    ) -> None:
        self._slots = slots
        self._starts = list(starts)
        self._per_slot = per_slot
        self._spec = spec
        self._device = device
        self.n_new = list(n_new)
        self.lengths = [s + n for s, n in zip(starts, n_new)]
        self.batch = len(self.lengths)
        self.pages = len(slots[0]) if slots else 0  # per sequence, when uniform
        self.uniform = len(slots) == 1 or (  # (one sequence: uniform; built per layer call)
            bool(slots)
            and all(len(s) == self.pages for s in slots)
            and len(set(self._starts)) == 1
            and len(set(self.n_new)) == 1
        )
        self._read: torch.Tensor | None = None
        self._read_np: npt.NDArray[np.int64] | None = None  # (the same rows: padded() indexes)
        self._padded: torch.Tensor | None = None
        self._page_index: torch.Tensor | None = None
        self._tok: npt.NDArray[np.int64] | None = None
        self._k: dict[bool, torch.Tensor] = {}

    @property
    def read(self) -> torch.Tensor:
        """The rows attention reads (built on first use)."""
        if self._read is None:
            self._build()
        assert self._read is not None
        return self._read

    def padded(self) -> torch.Tensor:
        """The rows of every sequence's K/V after the append, each padded to the longest:
        ``[B, 2, H, S_max]`` flattened, a padding row repeating the sequence's last token of
        that head (real, finite values, for a mask to hide). ``read`` itself when every
        sequence has the same length. Built once (a few numpy operations)."""
        got = self._padded
        if got is None:
            if len(set(self.lengths)) <= 1:
                got = self.read
            else:
                if self._read_np is None:
                    self._build()
                rows = self._read_np
                assert rows is not None
                lengths = np.array(self.lengths, dtype=np.int64)
                heads = 2 * self._spec.num_kv_heads  # (kv, head) pairs: the rows of one token
                smax = int(lengths.max())
                off = np.zeros(len(lengths), dtype=np.int64)
                np.cumsum(heads * lengths[:-1], out=off[1:])
                last = np.maximum(lengths - 1, 0).reshape(-1, 1, 1)
                at = np.minimum(np.arange(smax, dtype=np.int64).reshape(1, 1, -1), last)
                col = np.arange(heads, dtype=np.int64).reshape(1, -1, 1)
                pos = off.reshape(-1, 1, 1) + col * lengths.reshape(-1, 1, 1) + at
                np.minimum(pos, len(rows) - 1, out=pos)  # (a sequence of no tokens)
                got = torch.from_numpy(rows[pos.reshape(-1)])
                if self._device.type != "cpu":
                    got = got.to(self._device, non_blocking=True)
            self._padded = got
        return got

    @property
    def sizes(self) -> list[int]:
        """The rows of each sequence's K/V (after the append)."""
        return [2 * self._spec.num_kv_heads * s for s in self.lengths]

    @property
    def slots_count(self) -> int:
        """The device slots of every sequence's pages, in all."""
        return sum(len(s) for s in self._slots)

    def set_page_index(self, index: torch.Tensor) -> None:
        """:meth:`page_index`, built by the caller (a group's layers at once)."""
        self._page_index = index

    def page_index(self) -> torch.Tensor:
        """The device slots of every sequence's pages, sequence after sequence (uniform
        layers: ``batch * pages`` slots)."""
        got = self._page_index
        if got is None:
            got = _index([int(x) for s in self._slots for x in s], self._device)
            self._page_index = got
        return got

    def one_page(self) -> tuple[int, int] | None:
        """(slot, token in page) where the new tokens of a one-sequence layer start, when
        they all fall in that page (a decode step's token always does); else None."""
        if self.batch != 1 or not self.n_new[0]:
            return None
        t = self._spec.page_tokens
        start = self._starts[0]
        if start // t != (start + self.n_new[0] - 1) // t:
            return None
        return int(self._slots[0][start // t]), start % t

    def k_rows(self, by_seq: bool) -> torch.Tensor:
        """Rows of the new tokens' K, in the order of the new KV's elements."""
        kv = self.kv_rows(by_seq)
        return kv[: len(kv) // 2]

    def v_rows(self, by_seq: bool) -> torch.Tensor:
        """Rows of the new tokens' V (those of K, one K block further)."""
        kv = self.kv_rows(by_seq)
        return kv[len(kv) // 2 :]

    def kv_rows(self, by_seq: bool) -> torch.Tensor:
        """:meth:`k_rows` then :meth:`v_rows`, in one tensor (the rows of
        ``torch.stack((k, v))``'s elements): one index tensor, one ``index_copy_``."""
        got = self._k.get(by_seq)
        if got is None:
            h, t = self._spec.num_kv_heads, self._spec.page_tokens
            if sum(self.n_new) * h <= _PY_ROWS:
                k = self._py_k_rows(by_seq)
                got = _index(k + [x + h * t for x in k], self._device)
            else:
                kr = self._k_rows(by_seq)
                got = torch.from_numpy(np.concatenate((kr, kr + h * t)))
                if self._device.type != "cpu":
                    got = got.to(self._device)
            self._k[by_seq] = got
        return got

    def _py_k_rows(self, by_seq: bool) -> list[int]:
        """:meth:`_k_rows` in plain Python (a few new tokens: cheaper than numpy's setup)."""
        h, t, r = self._spec.num_kv_heads, self._spec.page_tokens, self._per_slot
        toks = [
            [int(s[p // t]) * r + p % t for p in range(start, end)]
            for s, start, end in zip(self._slots, self._starts, self.lengths)
        ]
        if by_seq:  # [B, H, n, D]: (b, head, j)
            return [x + i * t for tok in toks for i in range(h) for x in tok]
        return [x + i * t for i in range(h) for tok in toks for x in tok]  # [H, N, D]

    def _k_rows(self, by_seq: bool) -> npt.NDArray[np.int64]:
        if self._tok is None:
            self._build()
        assert self._tok is not None
        h = _heads(self._spec.num_kv_heads, self._spec.page_tokens)
        if by_seq:  # [B, H, n, D]: (b, head, j)
            n = self.n_new[0] if self.n_new else 0
            return (self._tok.reshape(self.batch, 1, n) + h.reshape(1, -1, 1)).reshape(-1)
        return (h.reshape(-1, 1) + self._tok.reshape(1, -1)).reshape(-1)  # [H, N, D]: (head, j)

    def _build(self) -> None:
        """``read`` and the new tokens' rows: a few numpy operations in all (one batch of
        them for a uniform layer, else a few per sequence)."""
        spec, per_slot = self._spec, self._per_slot
        h, t = spec.num_kv_heads, spec.page_tokens
        slots, starts, ends = self._slots, self._starts, self.lengths
        inner = _inner(h, t)
        read: npt.NDArray[np.int64]
        tok: npt.NDArray[np.int64]
        if self.uniform and len(set(ends)) == 1:
            b, m, end, start = len(slots), self.pages, ends[0], starts[0]
            base = np.array(slots, dtype=np.int64).reshape(b, 1, 1, m, 1) * per_slot
            read = (base + inner).reshape(b, 2, h, m * t)[..., :end].reshape(-1)
            pos = np.arange(start, end, dtype=np.int64)
            tok = (base.reshape(b, m)[:, pos // t] + pos % t).reshape(-1)
        else:
            reads, toks = [], []
            for s, start, end in zip(slots, starts, ends):
                base = np.array(s, dtype=np.int64).reshape(1, 1, -1, 1) * per_slot
                reads.append((base + inner).reshape(2, h, -1)[..., :end].reshape(-1))
                pos = np.arange(start, end, dtype=np.int64)
                toks.append(base.reshape(-1)[pos // t] + pos % t)
            read = np.concatenate(reads) if reads else np.empty(0, dtype=np.int64)
            tok = np.concatenate(toks) if toks else np.empty(0, dtype=np.int64)
        r = torch.from_numpy(read)
        if self._device.type != "cpu":
            r = r.to(self._device, non_blocking=True)
        self._read, self._read_np, self._tok = r, read, tok


# new tokens x heads up to which the append's rows are built in Python (numpy's fixed cost
# is larger there: a decode step of a few sequences)
_PY_ROWS = 256


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor of ``values`` (from a buffer: a third of torch.tensor's time)."""
    idx = torch.frombuffer(array("q", values), dtype=torch.int64) if values else _EMPTY
    return idx if device.type == "cpu" else idx.to(device)


_EMPTY = torch.empty(0, dtype=torch.int64)


@functools.lru_cache(maxsize=16)
def _heads(h: int, t: int) -> npt.NDArray[np.int64]:
    """The row offset of each head inside a K (or V) block of a slot."""
    out = np.arange(h, dtype=np.int64) * t
    out.setflags(write=False)
    return out


@functools.lru_cache(maxsize=16)
def _inner(h: int, t: int) -> npt.NDArray[np.int64]:
    """``[2, H, 1, T]``: the row of (kv, head, token in page) inside a slot."""
    kv = np.arange(2, dtype=np.int64).reshape(2, 1, 1, 1) * (h * t)
    head = np.arange(h, dtype=np.int64).reshape(1, h, 1, 1) * t
    out = kv + head + np.arange(t, dtype=np.int64).reshape(1, 1, 1, t)
    out.setflags(write=False)
    return out
