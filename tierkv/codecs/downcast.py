"""Lossless copy (``none``) and floating-point downcasts (``fp16``, ``bf16``).

Bounds, for an element ``x`` of a page and its decoded value ``x'`` (round to nearest even):

=====  ==========  ===============================  ===========================
codec  pages       ``|x' - x|`` at most             overflows (rounds to inf) at
=====  ==========  ===============================  ===========================
none   any dtype   0 (bit-exact, NaN/inf included)  -
fp16   fp16        0 (a copy)                       -
fp16   fp32, bf16  ``max(2^-11 * |x|, 2^-25)``      ``|x| >= 65520``
bf16   bf16        0 (a copy)                       -
bf16   fp32, fp16  ``max(2^-8 * |x|, 2^-134)``      ``|x| >= (2 - 2^-8) * 2^127``
=====  ==========  ===============================  ===========================

``2^-11`` and ``2^-8`` are the unit roundoffs of fp16 and bf16 (relative error in the normal
range); the absolute terms are half the smallest subnormal. A value at or beyond the overflow
threshold would round to inf: it raises :class:`CodecRangeError`, or with ``saturate=True`` it
is clamped to the largest finite value and its bound becomes ``|x| - max`` (stated by
:meth:`error_bound`). NaN and inf raise :class:`NonFiniteError` in the lossy cases. Decoding
``bf16`` into fp16 pages clamps to +-65504 (fp16 values above 65280 round to 65536 in bf16),
within the same bound.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tierkv.codecs.base import (
    Codec,
    CodecRangeError,
    as_pages,
    bad_pages,
    check_finite,
)
from tierkv.spec import KVSpec

# unit roundoff, half the smallest subnormal, largest finite, first value that rounds to inf
_LIMITS: dict[torch.dtype, tuple[float, float, float, float]] = {
    torch.float16: (2.0**-11, 2.0**-25, 65504.0, 65520.0),
    torch.bfloat16: (2.0**-8, 2.0**-134, (2 - 2.0**-7) * 2.0**127, (2 - 2.0**-8) * 2.0**127),
}


class IdentityCodec(Codec):
    """``none``: the page bytes as they are, behind the header. Lossless for every dtype."""

    name: ClassVar[str] = "none"
    codec_id: ClassVar[int] = 0
    lossless: ClassVar[bool] = True
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (*Codec.dtypes, torch.float8_e4m3fn)

    def scale_bytes(self, spec: KVSpec) -> int:
        """No scales."""
        return 0

    def payload_bytes(self, spec: KVSpec) -> int:
        """The unpadded K and V bytes of the page."""
        return 2 * spec.kv_bytes

    def error_bound(self, pages: torch.Tensor, spec: KVSpec) -> torch.Tensor:
        """Zero: decoding returns the same bits."""
        return torch.zeros((), dtype=torch.float64)

    def _check(self, x: torch.Tensor) -> None:
        """Any bits go, NaN and inf included."""

    def _encode(self, x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
        payload.view(x.dtype).view(x.shape).copy_(x)

    def _decode(self, scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(out.dtype).view(out.shape))


class DowncastCodec(Codec):
    """Store elements as ``target`` (fp16 or bf16); decoding widens them back exactly.

    Args:
        saturate: clamp values beyond the target's range to its largest finite value
            instead of raising :class:`CodecRangeError`.
    """

    target: ClassVar[torch.dtype]

    def __init__(self, saturate: bool = False) -> None:
        self.saturate = saturate

    def __repr__(self) -> str:
        return f"{type(self).__name__}(saturate={self.saturate})"

    def scale_bytes(self, spec: KVSpec) -> int:
        """No scales."""
        return 0

    def payload_bytes(self, spec: KVSpec) -> int:
        """Two bytes per element."""
        return spec.page_elems * 2

    def _check(self, x: torch.Tensor) -> None:
        if x.dtype == self.target:
            return
        amax = check_finite(x, self.name)
        over = amax >= _LIMITS[self.target][3]
        if not self.saturate and bool(over.any()):
            raise CodecRangeError(
                f"{self.name}: pages {bad_pages(over)} hold values up to "
                f"{float(amax.max()):.6g}, beyond {self.target}'s largest "
                f"{_LIMITS[self.target][2]:.6g} (use saturate=True to clamp)"
            )

    def error_bound(self, pages: torch.Tensor, spec: KVSpec) -> torch.Tensor:
        """``max(u * |x|, tiny)``, and ``|x| - max`` where saturated (see the module table)."""
        x = as_pages(pages, spec, "pages")
        self.check_spec(spec)
        self._check(x)
        if x.dtype == self.target:
            return torch.zeros((), dtype=torch.float64)
        u, tiny, fmax, _ = _LIMITS[self.target]
        ax = x.double().abs()
        return torch.maximum(torch.clamp(ax * u, min=tiny), ax - fmax)

    def _encode(self, x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
        dst = payload.view(self.target).view(x.shape)
        if self.saturate and x.dtype != self.target:
            fmax = _LIMITS[self.target][2]
            dst.copy_(x.float().clamp(-fmax, fmax))
        else:
            dst.copy_(x)

    def _decode(self, scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(payload.view(self.target).view(out.shape))
        fmax = torch.finfo(out.dtype).max
        if fmax < torch.finfo(self.target).max:  # bf16 of an fp16 65504 is 65536: inf in fp16
            out.clamp_(-fmax, fmax)


class Fp16Codec(DowncastCodec):
    """``fp16``: half precision, ~2x smaller than fp32 pages; bounds in the module table."""

    name: ClassVar[str] = "fp16"
    codec_id: ClassVar[int] = 1
    target: ClassVar[torch.dtype] = torch.float16


class Bf16Codec(DowncastCodec):
    """``bf16``: bfloat16, fp32's range with 8 significant bits; bounds in the module table."""

    name: ClassVar[str] = "bf16"
    codec_id: ClassVar[int] = 2
    target: ClassVar[torch.dtype] = torch.bfloat16
