"""Symmetric int8 quantization with fp32 scales: per channel (``int8``) or per group.

``int8`` keeps one scale per (K/V, head, channel d) across the page's T tokens; ``int8-group``
keeps one per group of G consecutive elements along head_dim (one per (K/V, head, token,
group)). With ``amax`` the largest ``|x|`` a scale covers::

    s  = next fp32 above fl(amax / 127)      (so 127 * s >= amax exactly, and s > 0)
    q  = round_half_even(fl(x / s))          (|q| <= 127, q = 0 where x = 0)
    x' = q * s  in fp32 (clamped to the finite range), then rounded to the page dtype

Bound, per element (what :meth:`error_bound` returns)::

    |x' - x| <= s * (1/2 + 2^-16) + u * (|x| + s) + tiny

``s/2`` is the quantization step; ``2^-16 * s`` covers fp32 rounding in ``x / s`` and
``q * s`` (at most ``127 * 2^-24 * s`` each); ``u * (|x| + s) + tiny`` is the final rounding to
the page dtype (u = 2^-11 fp16, 2^-8 bf16, 2^-24 fp32; tiny = half its smallest subnormal).
Before that last rounding the error is at most ``s * (1/2 + 2^-16)``. Pages with NaN or inf
raise :class:`NonFiniteError`; every finite value, subnormals to the dtype's max, is handled.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tierkv.codecs import fast
from tierkv.codecs.base import Codec, as_pages, check_finite
from tierkv.errors import SpecError
from tierkv.spec import KVSpec

QMAX = 127
_SLACK = 0.5 + 2.0**-16
# unit roundoff and half the smallest subnormal of each page dtype
_ROUND: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float32: (2.0**-24, 2.0**-150),
}
_INF = torch.tensor(float("inf"))
_F32_MAX = torch.finfo(torch.float32).max
_NEAR_MAX = _F32_MAX / 128


class Int8Codec(Codec):
    """``int8``: one fp32 scale per (K/V, head, channel); ~2x smaller than fp16 pages."""

    name: ClassVar[str] = "int8"
    codec_id: ClassVar[int] = 3

    def _groups(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``x`` reshaped so one scale covers a reduction along the returned dim."""
        return x, 3  # [N, 2, H, T, D], reduce over T

    def _scale_shape(self, spec: KVSpec) -> tuple[int, ...]:
        return (2, spec.num_kv_heads, 1, spec.head_dim)

    def scale_bytes(self, spec: KVSpec) -> int:
        """Four bytes per scale."""
        n = 1
        for d in self._scale_shape(spec):
            n *= d
        return 4 * n

    def payload_bytes(self, spec: KVSpec) -> int:
        """One byte per element."""
        return spec.page_elems

    def _scales(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A grouped fp32 copy of finite pages ``x`` and their scales (keepdim)."""
        xf = x.to(torch.float32, copy=True)  # fp32 reductions over short rows vectorize, fp16 not
        xg, dim = self._groups(xf)
        amax = torch.maximum(-xg.amin(dim=dim, keepdim=True), xg.amax(dim=dim, keepdim=True))
        # one ulp up makes 127 * s >= amax exactly (and s > 0): |x / s| <= 127, no clamp
        return xg, torch.nextafter(amax.div_(QMAX), _INF)

    def error_bound(self, pages: torch.Tensor, spec: KVSpec) -> torch.Tensor:
        """``s * (1/2 + 2^-16) + u * (|x| + s) + tiny`` per element (see the module doc)."""
        self.check_spec(spec)
        x = as_pages(pages, spec, "pages")
        self._check_group(spec)
        self._check(x)
        xg, s = self._scales(x)
        u, tiny = _ROUND[spec.dtype]
        sd = s.double()
        bound = sd * _SLACK + u * (xg.double().abs() + sd) + tiny  # xg is exactly x
        return bound.reshape(x.shape)

    def _check_group(self, spec: KVSpec) -> None:
        pass

    def _check(self, x: torch.Tensor) -> None:
        check_finite(x, self.name)

    def encoded_bytes(self, spec: KVSpec) -> int:
        """Header + fp32 scales + one byte per element, padded to 128 bytes."""
        self._check_group(spec)
        return super().encoded_bytes(spec)

    def _encode(self, x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
        q, s = self._scales(x)
        q.div_(s).round_()
        payload.view(torch.int8).view(q.shape).copy_(q)
        scales.view(torch.float32).view(s.shape).copy_(s)

    def _decode(self, scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor) -> None:
        if fast.dequant(scales, payload, out, self.group_size):  # one pass, bit-identical
            return
        n = out.shape[0]
        # (base.decode hands the native path every page at once: chunk the torch path here)
        step = max(1, self.chunk_bytes // max(1, out[0].numel() * out.element_size()))
        for i in range(0, n, step):
            self._decode_torch(scales[i : i + step], payload[i : i + step], out[i : i + step])

    def _decode_torch(self, scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor) -> None:
        n = out.shape[0]
        og, _ = self._groups(out)
        s = scales.view(torch.float32).view(n, *self._scale_shape_of(og))
        q = payload.view(torch.int8).view(og.shape)
        if og.dtype == torch.float32:
            torch.mul(q.to(torch.float32), s, out=og)
        else:  # mixed-dtype mul with a cast on output is slow on CPU: widen, scale, narrow
            og.copy_(q.to(torch.float32).mul_(s))
        if og.dtype == torch.float32 and bool((s > _NEAR_MAX).any()):
            og.clamp_(-_F32_MAX, _F32_MAX)  # 127 * s may round past FLT_MAX to inf

    def _decode_chunk(self, spec: KVSpec) -> int:
        # the native decode makes no temporaries; _decode chunks the torch path itself
        return 1 << 30

    def _scale_shape_of(self, og: torch.Tensor) -> tuple[int, ...]:
        _, two, h, _, d = og.shape
        return (two, h, 1, d)


class Int8GroupCodec(Int8Codec):
    """``int8-group``: one fp32 scale per G consecutive elements along head_dim.

    Args:
        group_size: G, elements per scale (default 32); must divide ``head_dim``.

    Raises:
        SpecError: ``group_size`` is not positive, or does not divide the spec's head_dim.
    """

    name: ClassVar[str] = "int8-group"
    codec_id: ClassVar[int] = 4

    def __init__(self, group_size: int = 32) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise SpecError(f"int8-group: group_size must be a positive int, got {group_size!r}")
        self.group_size = group_size

    def __repr__(self) -> str:
        return f"Int8GroupCodec(group_size={self.group_size})"

    def _check_group(self, spec: KVSpec) -> None:
        if spec.head_dim % self.group_size:
            raise SpecError(
                f"int8-group: group_size {self.group_size} does not divide head_dim {spec.head_dim}"
            )

    def _groups(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        n, two, h, t, d = x.shape
        return x.view(n, two, h, t, d // self.group_size, self.group_size), 5

    def _scale_shape(self, spec: KVSpec) -> tuple[int, ...]:
        g = spec.head_dim // self.group_size
        return (2, spec.num_kv_heads, spec.page_tokens, g, 1)

    def _scale_shape_of(self, og: torch.Tensor) -> tuple[int, ...]:
        return (*og.shape[1:5], 1)
