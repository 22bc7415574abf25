"""The native one-pass int8 decode (tierkv/codecs/_dequant.c) and when it applies.

:func:`dequant` decodes int8 / int8-group payloads straight into the pages in one pass (read
an int8, widen, one fp32 multiply, round to the page dtype, store), bit-identical to the torch
path of :mod:`.int8` (``q.float() * s`` rounded to the page dtype) and about twice its speed
(``benchmarks/sparse.py``: host decompression against memcpy). :data:`ISA` says which path the
module picked on this CPU: ``"avx512"`` (AVX-512 F/BW/VL, 16 channels per instruction) or
``"c"`` (portable C); None without the extension (no compiler at install).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

__all__ = ["ISA", "bad_scales", "dequant", "torch_path"]

_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _module() -> ModuleType | None:
    try:
        return importlib.import_module(f"{__package__}._dequant")
    except ImportError:
        return None


_NATIVE = _module()
ISA: str | None = None if _NATIVE is None else str(_NATIVE.ISA)


@contextmanager
def torch_path() -> Iterator[None]:
    """Decode with the torch path inside the block (benchmarks and tests compare the two;
    not thread-safe: every decode of the process takes the torch path meanwhile)."""
    global _NATIVE
    saved, _NATIVE = _NATIVE, None
    try:
        yield
    finally:
        _NATIVE = saved


def _rows(t: torch.Tensor, width: int) -> bool:
    """``t`` is ``[n, >= width]`` uint8 on the cpu with contiguous rows."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.uint8
        and t.dim() == 2
        and t.shape[1] >= width
        and (t.shape[1] <= 1 or t.stride(1) == 1)
    )


def dequant(
    scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor, group_size: int
) -> bool:
    """Decode ``n`` pages' int8 ``payload`` ``[n, 2*H*T*D]`` with fp32 ``scales`` (per channel
    when ``group_size`` is 0, else per ``group_size`` elements) into ``out`` ``[n, 2, H, T, D]``
    (pages contiguous each, any page stride). Returns False, touching nothing, when the native
    module is missing or the tensors are not laid out for it (the caller then uses torch)."""
    if _NATIVE is None or out.dtype not in _DTYPES or out.dim() != 5 or out.device.type != "cpu":
        return False
    n, two, h, t, d = out.shape
    per_page = two * h * t * d
    if n == 0 or per_page == 0:
        return n == 0
    if not out[0].is_contiguous() or (n > 1 and out.stride(0) < per_page):
        return False
    want = 4 * two * h * (d if group_size == 0 else t * (d // group_size))
    if not (_rows(payload, per_page) and _rows(scales, want)) or payload.shape[0] != n:
        return False
    if group_size < 0 or (group_size and d % group_size):
        return False
    esize = out.element_size()
    _NATIVE.dequant(
        out.data_ptr(),
        out.stride(0) * esize,
        payload.data_ptr(),
        payload.stride(0),
        scales.data_ptr(),
        scales.stride(0),
        n,
        two * h,
        t,
        d,
        group_size,
        _DTYPES[out.dtype],
    )
    return True


def bad_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[n]`` bool: the pages of ``scales`` (``[n, 4 * count]`` uint8 rows of fp32) holding a
    negative, NaN or infinite scale (-0.0 passes). Native where it applies, else torch."""
    n = scales.shape[0] if scales.dim() == 2 else 0
    if _NATIVE is not None and n and _rows(scales, 4) and scales.shape[1] % 4 == 0:
        mask = torch.empty(n, dtype=torch.uint8)
        _NATIVE.bad_scales(
            scales.data_ptr(), scales.stride(0), n, scales.shape[1] // 4, mask.data_ptr()
        )
        return mask.bool()
    sv = scales.view(torch.float32)
    return ~(torch.isfinite(sv) & (sv >= 0)).all(dim=1)
