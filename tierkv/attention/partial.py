"""Partial attention over a part of the keys, and the exact log-sum-exp merge of parts.

Attention of a query ``q`` over keys split into parts ``P_1 .. P_m`` (device pages, host pages,
chunks of either) is computed part by part and merged without approximation. Each part keeps,
per query row (batch, query head, query token)::

    m   = max_j s_j                        s_j = scale * q . k_j + bias_j    (j in the part)
    l   = sum_j exp(s_j - m)
    o   = sum_j exp(s_j - m) v_j           (unnormalized)

and the merge of parts is ``M = max_i m_i``, ``L = sum_i l_i exp(m_i - M)``,
``O = sum_i o_i exp(m_i - M)``; attention is ``O / L``. Within a part the keys are read in
chunks of ``chunk`` tokens with the same running update (flash attention's), so a part's
temporaries stay ``chunk`` wide whatever its length. Everything is computed in float32; a
part with no key (or every key masked) has ``m = -inf, l = 0, o = 0`` and weighs nothing.

Grouped-query attention: ``q`` has ``Hq = g * Hkv`` heads, query head ``h`` reads KV head
``h // g`` (transformers' ``repeat_kv`` order).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierkv.errors import InvalidInputError, InvalidTypeError, SpecError

__all__ = ["Partial", "attend", "finish", "merge", "partial_attention"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Partial:
    """One part's attention state: ``m``, ``l`` ``[B, Hq, n]`` and ``o`` ``[B, Hq, n, Dv]``,
    all float32 (see the module docstring)."""

    m: torch.Tensor
    l: torch.Tensor  # noqa: E741 (the name the literature gives it)
    o: torch.Tensor

    @property
    def nbytes(self) -> int:
        """Bytes of the state (what a host part sends to the device instead of its pages)."""
        return sum(t.numel() * t.element_size() for t in (self.m, self.l, self.o))

    def to(self, device: torch.device | str) -> Partial:
        """The same state on ``device``."""
        return Partial(self.m.to(device), self.l.to(device), self.o.to(device))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> int:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)) or not (
        bias is None or isinstance(bias, torch.Tensor)
    ):
        raise InvalidTypeError("q, k, v (and a bias) must be torch.Tensors")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise SpecError(
            f"q, k, v must be [B, H, n, D] tensors, got {list(q.shape)} {list(k.shape)} "
            f"{list(v.shape)}"
        )
    b, hq, n, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or k.shape[:3] != v.shape[:3]:
        raise SpecError(f"k {list(k.shape)} and v {list(v.shape)} do not match q {list(q.shape)}")
    if k.shape[3] != d:
        raise SpecError(f"k's head dim {k.shape[3]} differs from q's {d}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise SpecError(f"{hq} query heads cannot share {hkv} KV heads")
    if bias is not None:
        s = k.shape[2]
        if bias.dim() != 4 or bias.shape[2:] != (n, s) or bias.shape[1] not in (1, hq):
            raise SpecError(f"bias must broadcast as [B, 1|Hq, {n}, {s}], got {list(bias.shape)}")
    return hq // hkv


def empty_partial(q: torch.Tensor, dv: int) -> Partial:
    """The state of a part with no key (weighs nothing in a merge). Raises SpecError for a
    ``q`` that is no ``[B, Hq, n, D]`` tensor or a ``dv`` that is no int >= 0."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise SpecError("q must be a [B, Hq, n, D] tensor")
    if isinstance(dv, bool) or not isinstance(dv, int) or dv < 0:
        raise SpecError(f"dv must be an int >= 0, got {dv!r}")
    b, hq, n, _ = q.shape
    m = torch.full((b, hq, n), _NEG_INF, dtype=torch.float32, device=q.device)
    return Partial(m, torch.zeros_like(m), torch.zeros(b, hq, n, dv, device=q.device))


def partial_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    chunk: int = 1024,
) -> Partial:
    """The :class:`Partial` of ``q`` ``[B, Hq, n, D]`` over ``k``, ``v`` ``[B, Hkv, S, D]``.

    ``bias`` (additive, ``-inf`` masks a key) broadcasts as ``[B, 1|Hq, n, S]``. Keys are read
    ``chunk`` tokens at a time. Raises SpecError for shapes that do not fit together or a
    ``chunk`` below 1, InvalidTypeError for arguments that are no tensors, InvalidInputError for
    a ``scale`` that is no finite number (a NaN made every output NaN).
    """
    g = _check(q, k, v, bias)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise InvalidInputError(f"scale must be a finite number, got {scale!r:.40}")
    if chunk < 1:
        raise SpecError(f"chunk must be >= 1, got {chunk}")
    b, hq, n, d = q.shape
    hkv, s, dv = k.shape[1], k.shape[2], v.shape[3]
    if s == 0:
        return empty_partial(q, dv)
    # [B, Hkv, g*n, D]: each KV head's query rows together, one matmul per chunk
    qg = q.float().reshape(b, hkv, g * n, d)
    if bias is not None:
        bias = bias.float().expand(b, hq, n, s).reshape(b, hkv, g * n, s)
    m = torch.full((b, hkv, g * n), _NEG_INF, dtype=torch.float32, device=q.device)
    den = torch.zeros_like(m)
    o = torch.zeros(b, hkv, g * n, dv, dtype=torch.float32, device=q.device)
    for c in range(0, s, chunk):
        e = min(s, c + chunk)
        sc = torch.matmul(qg, k[:, :, c:e].float().transpose(-1, -2)).mul_(scale)
        if bias is not None:
            sc.add_(bias[..., c:e])
        new_m = torch.maximum(m, sc.amax(dim=-1))
        safe = torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m))
        p = torch.exp(sc - safe.unsqueeze(-1))
        alpha = torch.exp(m - safe).unsqueeze(-1)  # 0 for an empty running state
        den = den * alpha.squeeze(-1) + p.sum(dim=-1)
        o = o * alpha + torch.matmul(p, v[:, :, c:e].float())
        m = new_m
    return Partial(m.reshape(b, hq, n), den.reshape(b, hq, n), o.reshape(b, hq, n, dv))


def merge(parts: Sequence[Partial]) -> Partial:
    """The exact merge of parts of one query's attention (log-sum-exp; module docstring).

    Raises SpecError for no parts or parts of different shapes, InvalidTypeError for a part
    that is no :class:`Partial`.
    """
    if not parts:
        raise SpecError("merge needs at least one part")
    if not all(isinstance(p, Partial) for p in parts):
        raise InvalidTypeError("merge takes Partial states (partial_attention's)")
    shape = parts[0].o.shape
    if any(p.o.shape != shape for p in parts):
        raise SpecError(f"parts of different shapes: {[list(p.o.shape) for p in parts]}")
    if len(parts) == 1:
        return parts[0]
    big = torch.stack([p.m for p in parts]).amax(dim=0)
    safe = torch.where(torch.isfinite(big), big, torch.zeros_like(big))
    den = torch.zeros_like(parts[0].l)
    o = torch.zeros_like(parts[0].o)
    for p in parts:
        w = torch.exp(p.m - safe)
        den = den + p.l * w
        o = o + p.o * w.unsqueeze(-1)
    return Partial(big, den, o)


def finish(part: Partial, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention ``O / L`` ``[B, Hq, n, Dv]`` in ``dtype`` (zero for a row with no key).
    Raises InvalidTypeError for a ``part`` that is no Partial or a ``dtype`` no torch.dtype."""
    if not isinstance(part, Partial) or not isinstance(dtype, torch.dtype):
        raise InvalidTypeError("finish takes a Partial and a torch.dtype")
    denom = torch.where(part.l > 0, part.l, torch.ones_like(part.l))
    return (part.o / denom.unsqueeze(-1)).to(dtype)


def attend(
    q: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    scale: float,
    chunk: int = 1024,
) -> torch.Tensor:
    """Attention of ``q`` over several ``(k, v, bias)`` parts, merged exactly; ``[B, Hq, n,
    Dv]`` in ``q``'s dtype. Raises SpecError as :func:`partial_attention`, InvalidTypeError
    for a part that is no ``(k, v, bias)`` triple."""
    if not all(isinstance(p, tuple | list) and len(p) == 3 for p in parts):
        raise InvalidTypeError("attend takes parts as (k, v, bias) triples (bias may be None)")
    got = [partial_attention(q, k, v, scale, bias, chunk) for k, v, bias in parts]
    return finish(merge(got), q.dtype)
