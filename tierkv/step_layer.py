"""One layer of a step (:mod:`tierkv.step`): the handle a caller appends through and reads
K/V from, with its precomputed rows (:mod:`tierkv.step_plan`); and the check of a step's
token counts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tierkv import validate
from tierkv.boundary import boundary
from tierkv.errors import InvalidTypeError, SequenceError, SpecError
from tierkv.lease_host import LeaseHost
from tierkv.sequence import SequenceState
from tierkv.step_plan import LayerRows

__all__ = ["LayerStep", "StepView", "check_tokens"]


class StepView(Protocol):
    """What a layer needs of its step (:class:`tierkv.step.StepPlan` implements it)."""

    store: LeaseHost
    seqs: tuple[SequenceState, ...]
    flat: torch.Tensor  # the device pages as rows of head_dim elements
    pages: torch.Tensor  # the device pages, [slots, 2, H, T, D]
    by_page: torch.Tensor  # the device pages as [2, H, slots, T, D] (a view)
    page_strides: tuple[int, ...]  # the strides of ``pages``
    page_offset: int  # the storage offset of ``pages``

    def check_current(self, step: LayerStep) -> None:
        """Raise SequenceError unless ``step`` is the step's current layer."""
        ...


class LayerStep:
    """One layer of a step: its pages pinned on the device, its rows precomputed.

    Got from :meth:`StepPlan.layer`; valid until the plan's next ``layer()`` call or its exit.
    """

    __slots__ = (
        "_plan",
        "_rows",
        "appended",
        "filled",
        "keys",
        "landed",
        "layer",
        "loaded",
        "new",
        "starts",
        "written",
    )

    def __init__(
        self,
        plan: StepView,
        layer: int,
        keys: list[bytes],
        new: list[bytes],
        filled: list[bytes],
        written: list[bytes],
        starts: list[int],
        rows: LayerRows,
    ) -> None:
        self._plan = plan
        self.layer = layer
        self.keys = keys  # the layer's pages this step pinned (acquired)
        self.new = new  # the pages the append opens (reserved, owned, pinned)
        self.filled = filled  # the pages the append fills (sealed when its group is let go)
        self.written = written  # the pages the append writes (marked dirty with its group)
        self.starts = starts
        self._rows = rows
        self.appended = not any(rows.n_new)
        self.loaded = 0  # pages its group loaded (on the group's first layer)
        self.landed = 0.0  # when their copies ended (time.perf_counter; 0.0: none loaded)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the new tokens' K and V: ``[B, H, n, D]`` (every sequence ``n`` tokens, in the
        plan's order) or ``[H, N, D]`` (the sequences' tokens one after another), in the
        spec's dtype, on the device tier's device or the cpu.

        Raises SpecError (shape, dtype, device), InvalidTypeError (not tensors),
        SequenceError (the layer is no longer current, appended already, a sequence released
        or appended to by someone else meanwhile); all before anything is written.
        """
        # One function for the common case (a decode layer's path runs cold inside a model's
        # forward, where every call costs microseconds): the checks of [B, H, n, D] tensors
        # in the spec's dtype on the pages' device inline, anything else via _check_kv. No
        # error boundary (a frame more a call): nothing here raises the runtime's errors
        plan = self._plan
        rows = self._rows
        store = plan.store
        spec = store.spec
        dev = plan.flat.device
        if (
            type(k) is torch.Tensor
            and type(v) is torch.Tensor
            and rows.uniform
            and k.shape == v.shape
            and k.shape == (rows.batch, spec.num_kv_heads, rows.n_new[0], spec.head_dim)
            and k.dtype == spec.dtype
            and v.dtype == spec.dtype
            and k.device == dev
            and v.device == dev
            and k.layout == torch.strided
            and v.layout == torch.strided
            and not k.is_nested
            and not v.is_nested
        ):
            by_seq = fast = True
        else:
            by_seq = self._check_kv(k, v)
            fast = False
        plan.check_current(self)
        if self.appended:
            if not any(rows.n_new):  # a step of no new tokens: its empty KV has nothing to add
                return
            raise SequenceError(f"layer {self.layer}: this step appended to it already")
        seqs, layer = plan.seqs, self.layer
        is_live = store.is_live
        for seq, start in zip(seqs, self.starts):
            if not is_live(seq) or seq.kv_len_of(layer) != start:
                raise SequenceError(
                    f"sequence {seq.seq_id!r} layer {layer}: released or appended to outside "
                    "this step (nothing was appended)"
                )
        if k.requires_grad or v.requires_grad:  # a cache holds values, not a graph
            k, v = k.detach(), v.detach()
        if not fast and k.device != dev:  # (the inline check compared the devices)
            k, v = k.to(dev), v.to(dev)
        at = rows.one_page() if by_seq and rows.batch == 1 else None
        if at is not None:  # one sequence, its new tokens in one page: one cat into its slot
            slot, p = at  # (the slot's tokens p.. as one as_strided: cheaper than indexing)
            s0, s1, s2, s3, s4 = plan.page_strides
            size = (2, spec.num_kv_heads, k.shape[2], spec.head_dim)
            into = plan.pages.as_strided(
                size, (s1, s2, s3, s4), plan.page_offset + slot * s0 + p * s3
            )
            torch.cat((k, v), out=into)
        else:
            flat = plan.flat
            flat.index_copy_(0, rows.kv_rows(by_seq), torch.stack((k, v)).view(-1, spec.head_dim))
        # (the written pages are marked dirty, and the filled ones sealed, their CRC-32C
        # taken, for the group's layers at once when the step lets go of it: pinned until
        # then, none can be evicted or written back meanwhile)
        for seq, end in zip(seqs, rows.lengths):
            seq.set_kv_len(layer, end)
        self.appended = True

    def _check_kv(self, k: object, v: object) -> bool:
        """Check new KV; True for ``[B, H, n, D]``, False for ``[H, N, D]``."""
        plan = self._plan
        spec = plan.store.spec
        rows = self._rows
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise InvalidTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
        h, d = spec.num_kv_heads, spec.head_dim
        uniform = len(set(rows.n_new)) == 1
        shapes: list[tuple[int, ...]] = [(h, sum(rows.n_new), d)]
        if uniform:
            shapes.append((rows.batch, h, rows.n_new[0], d))
        for name, x in (("k", k), ("v", v)):
            if tuple(x.shape) not in shapes:
                raise SpecError(f"{name}: expected shape {' or '.join(map(str, shapes))}")
            if x.dtype != spec.dtype:
                raise SpecError(f"{name}: expected dtype {spec.dtype}, got {x.dtype}")
            if x.is_nested or x.layout != torch.strided or x.device.type == "meta":
                raise SpecError(f"{name}: expected a dense tensor with data")
            if x.device != plan.flat.device and x.device.type != "cpu":
                raise SpecError(f"{name}: expected a tensor on {plan.flat.device} or the cpu")
        if k.shape != v.shape:
            raise SpecError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        return k.dim() == 4

    def _check_read(self) -> None:
        self._plan.check_current(self)
        if not self.appended:
            raise SequenceError(f"layer {self.layer}: append the step's tokens before reading")

    def _gather(self) -> torch.Tensor:
        self._check_read()
        return self._plan.flat.index_select(0, self._rows.read)

    def kv(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every sequence, ``[B, H, S, D]`` each (views of one gathered copy):
        every sequence must have the same length. ``out``: a contiguous tensor in the spec's
        dtype on the device tier's device to gather into (at least :meth:`gather_numel`
        elements): nothing is allocated, and the views are of ``out`` (the next gather into it
        overwrites them). Raises SequenceError (lengths differ: use :meth:`kv_list`; not
        appended yet; the layer no longer current), InvalidTypeError / SpecError (a bad
        ``out``)."""
        # (no error boundary, as append: torch's and the step's own errors only)
        rows = self._rows
        plan = self._plan
        uniform = rows.uniform  # (same pages, start and new tokens: the same lengths)
        if not uniform and len(set(rows.lengths)) > 1:
            raise SequenceError("the step's sequences differ in length: use kv_list()")
        spec = plan.store.spec
        h, d = spec.num_kv_heads, spec.head_dim
        s = rows.lengths[0] if rows.lengths else 0
        if out is not None:
            self._check_out(out, self.gather_numel())
        plan.check_current(self)
        if not self.appended:
            raise SequenceError(f"layer {self.layer}: append the step's tokens before reading")
        if uniform:  # whole pages, by slot: one index_select over a handful of indices
            t = spec.page_tokens
            b = rows.batch
            n = b * rows.pages  # the pages gathered
            m = rows.pages * t  # tokens of a sequence's whole pages
            index = rows.page_index()
            by_page = plan.by_page
            if out is None:
                got = by_page.index_select(2, index)
            else:  # (one dense as_strided, not a view, a slice and a view: each op costs
                # microseconds inside a forward)
                got = out.as_strided((2, h, n, t, d), (h * n * t * d, n * t * d, t * d, d, 1))
                torch.index_select(by_page, 2, index, out=got)
            # got is [2, H, B, m, D] dense: K and V [B, H, s, D] as two strided views of it
            shape, stride = (b, h, s, d), (m * d, b * m * d, d, 1)
            at = got.storage_offset()
            return got.as_strided(shape, stride), got.as_strided(shape, stride, at + h * b * m * d)
        flat = plan.flat
        if out is None:
            gathered = flat.index_select(0, rows.read)
        else:
            gathered = out.view(-1)[: len(rows.read) * d].view(-1, d)
            torch.index_select(flat, 0, rows.read, out=gathered)
        kv = gathered.view(rows.batch, 2, h, s, d)
        return kv[:, 0], kv[:, 1]

    @property
    def rows(self) -> LayerRows:
        """Its rows (:mod:`tierkv.step_plan`)."""
        return self._rows

    def gather_numel(self) -> int:
        """The elements :meth:`kv` gathers (whole pages where the layer is uniform)."""
        rows = self._rows
        spec = self._plan.store.spec
        per = 2 * spec.num_kv_heads * spec.head_dim
        if rows.uniform:
            return per * rows.batch * rows.pages * spec.page_tokens
        return per * sum(rows.lengths)

    def _check_out(self, out: object, need: int) -> None:
        flat = self._plan.flat
        if not isinstance(out, torch.Tensor):
            raise InvalidTypeError(f"out: expected a torch.Tensor, got {type(out).__name__}")
        if out.dtype != flat.dtype or out.device != flat.device:
            raise SpecError(f"out: expected a {flat.dtype} tensor on {flat.device}")
        if not out.is_contiguous() or out.numel() < need:
            raise SpecError(f"out: expected a contiguous tensor of >= {need} elements")
        if out.requires_grad or (out.is_inference() and not torch.is_inference_mode_enabled()):
            raise SpecError(  # (torch's RuntimeError inside index_select otherwise)
                "out: expected a tensor that does not require grad (and an inference "
                "tensor only inside torch.inference_mode())"
            )

    @boundary
    def kv_padded(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every sequence padded to the longest, ``[B, H, S_max, D]`` each (views
        of one gathered copy: one ``index_select``), for attention that masks each sequence's
        positions from ``lengths`` on; a padding position repeats the sequence's last token
        (finite values). ``out``: a contiguous tensor in the spec's dtype on the device
        tier's device, of at least ``B * 2 * H * S_max * D`` elements, to gather into (then
        nothing is allocated; the views are of ``out`` and the next gather into it overwrites
        them). Raises SequenceError (not appended yet; the layer no longer current),
        InvalidTypeError / SpecError (a bad ``out``)."""
        rows = self._rows
        flat = self._plan.flat
        spec = self._plan.store.spec
        h, d = spec.num_kv_heads, spec.head_dim
        s = max(rows.lengths, default=0)
        need = rows.batch * 2 * h * s
        if out is not None:
            self._check_out(out, need * d)
        self._plan.check_current(self)
        if not self.appended:
            raise SequenceError(f"layer {self.layer}: append the step's tokens before reading")
        index = rows.padded()
        if out is None:
            got = flat.index_select(0, index)
        else:
            got = out.view(-1)[: need * d].view(need, d)
            torch.index_select(flat, 0, index, out=got)
        kv = got.view(rows.batch, 2, h, s, d)
        return kv[:, 0], kv[:, 1]

    @property
    def lengths(self) -> list[int]:
        """Each sequence's K/V length after the append (the plan's order)."""
        return self._rows.lengths

    @boundary
    def kv_list(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V of each sequence, ``[H, S_b, D]`` each (views of one gathered copy)."""
        spec = self._plan.store.spec
        h, d = spec.num_kv_heads, spec.head_dim
        parts = self._gather().split(self._rows.sizes)
        out = []
        for p, s in zip(parts, self._rows.lengths):
            kv = p.view(2, h, s, d)
            out.append((kv[0], kv[1]))
        return out


def check_tokens(tokens: int | Sequence[int], n: int) -> list[int]:
    """``tokens`` as one count per sequence (an int: the same for all). Raises
    InvalidTypeError, SpecError."""
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        tokens = [tokens] * n
    if isinstance(tokens, str | bytes) or not isinstance(tokens, Sequence):
        raise InvalidTypeError(f"tokens: expected an int or a list of ints, got {tokens!r}")
    out = [validate.count("tokens", x, 0) for x in tokens]
    if len(out) != n:
        raise SpecError(f"tokens: {len(out)} counts for {n} sequences")
    return out
