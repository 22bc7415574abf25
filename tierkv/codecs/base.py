"""The codec interface for cold pages, and its errors.

A codec turns ``N`` pages (``[N, 2, H, T, D]`` in ``spec.dtype``, or ``[N, >= page_bytes]``
raw uint8 slots) into ``N`` self-contained encoded pages (``[N, encoded_bytes(spec)]`` uint8)
and back, in one batched call with no Python loop per page. The layout of an encoded page is
drawn in :mod:`tierkv.codecs.header`.

Errors (all under :class:`~tierkv.errors.TierKVError`)::

    TierKVError
     ├── SpecError (also ValueError)       a tensor of the wrong shape/dtype, or a spec whose
     │                                     dtype the codec does not handle
     └── CodecError
          ├── NonFiniteError (ValueError)  NaN or inf in a page given to a lossy codec
          ├── CodecRangeError (OverflowError)  a value the target dtype cannot hold
          ├── CorruptEncodingError (ValueError) a short buffer or a bad header or bad scales
          └── UnknownCodecError (KeyError)     no codec of that name or id (an
                                               UnknownNameError like every registry's)

Every check runs before anything is written: a call that raises leaves ``out`` untouched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch
from torch import Tensor

from tierkv.codecs import fast
from tierkv.codecs.header import HEADER_BYTES, describe_mismatch, pack_header
from tierkv.errors import (
    CorruptPageError,
    InvalidTypeError,
    SpecError,
    TierKVError,
    UnknownNameError,
)
from tierkv.spec import ALIGN, KVSpec


class CodecError(TierKVError):
    """Root of the errors raised while encoding or decoding pages."""


class NonFiniteError(CodecError, ValueError):
    """A page holds NaN or inf and the codec is lossy (only ``none`` carries them)."""


class CodecRangeError(CodecError, OverflowError):
    """A page holds a value beyond the range of the codec's target dtype."""


class CorruptEncodingError(CodecError, CorruptPageError, ValueError):
    """An encoded buffer is too short, its header does not match, or its scales are bad (a
    :class:`~tierkv.errors.CorruptPageError` of the cold tier)."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg, tier="cold")


class UnknownCodecError(CodecError, UnknownNameError, KeyError):
    """No codec is registered under that name (or header id)."""


Layers = Sequence[int] | torch.Tensor | None
"""Each page's layer, for a codec that needs it (:attr:`Codec.needs_layers`)."""

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def bad_pages(mask: torch.Tensor) -> str:
    """Render the indices of the ``True`` rows of a ``[N]`` mask (at most 8) for a message."""
    idx = mask.nonzero().flatten().tolist()
    more = f" and {len(idx) - 8} more" if len(idx) > 8 else ""
    return ", ".join(map(str, idx[:8])) + more


def page_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest ``|x|`` of each page as ``[N]`` fp32; NaN for a page holding NaN."""
    flat = x.reshape(x.shape[0], -1)
    return torch.maximum(-flat.amin(dim=1).float(), flat.amax(dim=1).float())


def check_finite(x: torch.Tensor, codec: str) -> torch.Tensor:
    """:func:`page_amax` of ``x``; raises NonFiniteError naming the pages with NaN or inf."""
    amax = page_amax(x)
    bad = ~torch.isfinite(amax)
    if bool(bad.any()):
        raise NonFiniteError(f"{codec}: pages {bad_pages(bad)} hold NaN or inf")
    return amax


class _CodecTypeError(SpecError, InvalidTypeError):
    """A codec was given something that is no tensor (or no KVSpec)."""


def as_pages(t: torch.Tensor, spec: KVSpec, what: str) -> torch.Tensor:
    """View ``t`` as ``[N, 2, H, T, D]`` pages of ``spec.dtype`` (no copy).

    ``t`` is either that shape and dtype already, or ``[N, L]`` uint8 with ``L >= 2*kv_bytes``
    and a contiguous last dimension (arena slots). Raises SpecError otherwise (InvalidTypeError,
    also a SpecError, for something that is no tensor: a list was an AttributeError).
    """
    if not isinstance(t, torch.Tensor):
        raise _CodecTypeError(f"{what}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.uint8 and t.dim() == 2:
        need = 2 * spec.kv_bytes
        if t.shape[1] < need:
            raise SpecError(f"{what}: slots of {t.shape[1]} bytes cannot hold a {need}-byte page")
        try:
            return t[:, :need].view(spec.dtype).view(t.shape[0], *spec.page_shape)
        except RuntimeError as exc:
            raise SpecError(f"{what}: uint8 slots must be contiguous and aligned: {exc}") from exc
    if t.dim() != 5 or tuple(t.shape[1:]) != spec.page_shape:
        raise SpecError(
            f"{what}: expected [N, {', '.join(map(str, spec.page_shape))}] pages "
            f"or [N, >= {2 * spec.kv_bytes}] uint8 slots, got {list(t.shape)} {t.dtype}"
        )
    if t.dtype != spec.dtype:
        raise SpecError(f"{what}: expected dtype {spec.dtype}, got {t.dtype}")
    return t


def decode_target(
    out: torch.Tensor | None, n: int, spec: KVSpec, device: torch.device
) -> torch.Tensor:
    """Where a decode of ``n`` pages writes: ``out`` viewed as pages (uint8 slots get their
    padding up to ``page_bytes`` zeroed), or new pages. Raises SpecError for a wrong ``out``."""
    if out is None:
        return torch.empty((n, *spec.page_shape), dtype=spec.dtype, device=device)
    if out.shape[0] != n:
        raise SpecError(f"out: expected {n} pages, got {out.shape[0]}")
    view = as_pages(out, spec, "out")
    if out.dtype == torch.uint8 and out.shape[1] >= spec.page_bytes:
        out[:, 2 * spec.kv_bytes : spec.page_bytes] = 0
    return view


class Codec(ABC):
    """Encode and decode batches of KV pages to fixed-size, self-contained byte strings.

    Subclasses set ``name``, ``codec_id`` and ``lossless``, and implement the sizes, the
    batched ``_encode``/``_decode`` kernels and :meth:`error_bound`.
    """

    name: ClassVar[str]
    codec_id: ClassVar[int]
    lossless: ClassVar[bool] = False
    dtypes: ClassVar[tuple[torch.dtype, ...]] = FLOAT_DTYPES
    group_size: int = 0
    needs_layers: ClassVar[bool] = False  # encode(..., layers=) takes each page's layer
    chunk_bytes: ClassVar[int] = 1 << 19

    @abstractmethod
    def scale_bytes(self, spec: KVSpec) -> int:
        """Bytes of fp32 scales per encoded page (0 if the codec has none)."""

    @abstractmethod
    def payload_bytes(self, spec: KVSpec) -> int:
        """Bytes of encoded elements per page."""

    @abstractmethod
    def error_bound(self, pages: torch.Tensor, spec: KVSpec) -> torch.Tensor:
        """The absolute error this codec guarantees, per element, for these pages.

        Returns a float64 tensor broadcastable to ``[N, 2, H, T, D]`` such that
        ``|decode(encode(pages)) - pages| <= error_bound(pages)`` elementwise (zeros when
        lossless). Raises what :meth:`encode` raises for the same pages.
        """

    @abstractmethod
    def _check(self, x: torch.Tensor) -> None:
        """Raise if any page of ``x`` cannot be encoded; runs before anything is written."""

    @abstractmethod
    def _encode(self, x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None: ...

    @abstractmethod
    def _decode(self, scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor) -> None: ...

    def _chunk(self, spec: KVSpec) -> int:
        return max(1, self.chunk_bytes // spec.page_bytes)

    def _decode_chunk(self, spec: KVSpec) -> int:
        return self._chunk(spec)

    def check_spec(self, spec: KVSpec) -> None:
        """Raise SpecError if this codec cannot encode pages of ``spec.dtype``."""
        if spec.dtype not in self.dtypes:
            raise SpecError(f"codec {self.name!r} does not handle {spec.dtype} pages")

    def encoded_bytes(self, spec: KVSpec) -> int:
        """Size of one encoded page: header + scales + payload, padded to 128 bytes. Raises
        InvalidTypeError (also a SpecError) for a ``spec`` that is no KVSpec."""
        if not isinstance(spec, KVSpec):  # (None was an AttributeError)
            raise _CodecTypeError(f"spec: expected a tierkv.KVSpec, got {type(spec).__name__}")
        self.check_spec(spec)
        used = HEADER_BYTES + self.scale_bytes(spec) + self.payload_bytes(spec)
        return (used + ALIGN - 1) // ALIGN * ALIGN

    def compression_ratio(self, spec: KVSpec) -> float:
        """``page_bytes / encoded_bytes``: how many times smaller an encoded page is."""
        return spec.page_bytes / self.encoded_bytes(spec)

    def header(self, spec: KVSpec) -> torch.Tensor:
        """The 32 header bytes every page encoded by this codec under ``spec`` starts with."""
        return pack_header(self.codec_id, spec, self.group_size, self.encoded_bytes(spec))

    def encode(
        self,
        pages: torch.Tensor,
        spec: KVSpec,
        out: torch.Tensor | None = None,
        layers: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Encode ``N`` pages into ``[N, encoded_bytes(spec)]`` uint8 (``out`` if given).

        ``pages`` is ``[N, 2, H, T, D]`` in ``spec.dtype`` or ``[N, >= 2*kv_bytes]`` uint8
        slots. ``out`` is ``[N, >= encoded_bytes]`` uint8 that must not overlap ``pages``;
        only its first ``encoded_bytes`` columns are written. ``layers``: each page's layer,
        used by codecs with :attr:`needs_layers` (``head-sparse``), ignored by the others.

        Raises:
            SpecError: wrong shape or dtype, or a dtype this codec does not handle.
            NonFiniteError: a lossy codec was given NaN or inf.
            CodecRangeError: a value does not fit the target dtype.
        """
        size = self.encoded_bytes(spec)
        x = as_pages(pages, spec, "pages")
        n = x.shape[0]
        if out is None:
            out = torch.empty((n, size), dtype=torch.uint8, device=x.device)
        elif out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] != n:
            raise SpecError(f"out: expected [{n}, >= {size}] uint8, got {list(out.shape)}")
        elif out.shape[1] < size:
            raise SpecError(f"out: {out.shape[1]} bytes per page, the codec needs {size}")
        return self._encode_into(x, spec, out, layers)

    def _encode_into(self, x: Tensor, spec: KVSpec, out: Tensor, layers: Layers) -> Tensor:
        """Check ``x`` (pages) and encode it into ``out`` (checked): the chunked kernels, the
        headers and the padding. A codec with a layout of its own overrides this."""
        n, size = x.shape[0], self.encoded_bytes(spec)
        s_end = HEADER_BYTES + self.scale_bytes(spec)
        p_end = s_end + self.payload_bytes(spec)
        self._check(x)
        step = self._chunk(spec)
        for i in range(0, n, step):  # chunks of pages keep the fp32 temporaries in cache
            j = min(n, i + step)
            self._encode(x[i:j], out[i:j, HEADER_BYTES:s_end], out[i:j, s_end:p_end])
        out[:, :HEADER_BYTES] = self.header(spec).to(out.device)
        out[:, p_end:size] = 0
        return out

    def decode(
        self, data: torch.Tensor, spec: KVSpec, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decode ``[N, >= encoded_bytes]`` uint8 into ``[N, 2, H, T, D]`` pages.

        ``out`` may be ``[N, 2, H, T, D]`` in ``spec.dtype`` or ``[N, >= 2*kv_bytes]`` uint8
        slots (their padding up to ``page_bytes`` is zeroed); the pages view is returned.

        Raises:
            SpecError: ``data`` or ``out`` has the wrong shape or dtype.
            CorruptEncodingError: a buffer is short, a header does not match this codec and spec,
                or a stored scale is negative or not finite.
        """
        size = self.encoded_bytes(spec)
        if not isinstance(data, torch.Tensor):
            raise _CodecTypeError(f"data: expected a torch.Tensor, got {type(data).__name__}")
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise SpecError(
                f"data: expected [N, {size}] uint8, got {list(data.shape)} {data.dtype}"
            )
        if data.shape[1] < size:
            raise CorruptEncodingError(
                f"data: {data.shape[1]} bytes per page, need {size} ({self.name})"
            )
        n = data.shape[0]
        hdr = self.header(spec).to(data.device)
        bad = (data[:, :HEADER_BYTES] != hdr).any(dim=1)
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            why = describe_mismatch(data[first], hdr)
            raise CorruptEncodingError(f"pages {bad_pages(bad)}: header mismatch: {why}")
        s_end = HEADER_BYTES + self.scale_bytes(spec)
        scales = data[:, HEADER_BYTES:s_end]
        if s_end > HEADER_BYTES:
            bad = fast.bad_scales(scales)
            if bool(bad.any()):
                raise CorruptEncodingError(f"pages {bad_pages(bad)}: negative or non-finite scales")
        view = decode_target(out, n, spec, data.device)
        payload = data[:, s_end : s_end + self.payload_bytes(spec)]
        step = self._decode_chunk(spec)
        for i in range(0, n, step):
            self._decode(scales[i : i + step], payload[i : i + step], view[i : i + step])
        return view
