"""``head-sparse``: cold pages keep their layer's top KV heads in 16 bits, the others in int8.

Most KV heads of a decoder attend to their recent tokens; a few ("retrieval heads":
RazorAttention, DuoAttention) reach far back. :class:`HeadRanking` holds, per layer and KV head,
the share of attention a head places on keys more than ``window`` tokens behind the query,
measured once on calibration text (:func:`tierkv.codecs.head_calibration.calibrate`) and saved
beside the model's spec (:meth:`HeadRanking.save`). A cold page (old by nature) of layer ``l``
keeps the ``keep`` heads of ``l`` that rank highest in ``full`` precision (float16, or the page
dtype when that is 16-bit already: a copy) and the others in int8, K with a float16 scale per
(head, channel) over the page's tokens (keys' outliers sit in channels) and V with one per
(head, token) over the channels (KIVI's split): ``2 (H-keep) (D + T)`` scale bytes a page
instead of ``4 (H-keep) D`` for a scale per channel of both, which is what brings SmolLM2's
16-token pages (3 KV heads, one kept) from 0.72 to 0.698 of fp16.

Layout (sizes fixed by the spec and ``keep``; codec id 6: id 5 was the layout with a scale
per channel of V too, refused)::

    header (32 B; G = keep) | layer u32, head order (H bytes, the kept first), padded to 4 |
    K scales fp16 [H-keep][D] | V scales fp16 [H-keep][T] |
    kept heads [2][keep][T][D] in `full` | int8 [2][H-keep][T][D]

Bounds per element (``s`` the fp16 scale covering the int8 element, its K channel's or its V
token's: ``127 s >= amax`` over what it covers, exactly):
kept heads as the ``fp16`` codec (``max(2^-11 |x|, 2^-25)``; 0 for a 16-bit page's copy;
``|x| >= 65520`` raises CodecRangeError), int8 heads as the ``int8`` codec,
``s (1/2 + 2^-16) + u (|x| + s) + tiny``. An amax above ``127 * 65504`` raises CodecRangeError.

The codec needs each page's layer: :meth:`encode` and :meth:`error_bound` take ``layers``
(the store's cold tier passes them, read from the page keys). Errors: CalibrationError (no
ranking, or one whose layers or KV heads differ from the spec), SpecError (bad ``keep``, bad
``layers``), NonFiniteError, CodecRangeError, CorruptEncodingError (header, layer, head order
or scales of a page do not match).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from tierkv.codecs.base import (
    Codec,
    CodecError,
    CodecRangeError,
    CorruptEncodingError,
    Layers,
    as_pages,
    bad_pages,
    check_finite,
    decode_target,
)
from tierkv.codecs.header import HEADER_BYTES, describe_mismatch
from tierkv.errors import SpecError
from tierkv.spec import KVSpec

__all__ = ["CalibrationError", "HeadRanking", "HeadSparseCodec"]

QMAX = 127
_F16_MAX = 65504.0
_SLACK = 0.5 + 2.0**-16
_ROUND = {
    torch.float16: (2.0**-11, 2.0**-25),
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float32: (2.0**-24, 2.0**-150),
}


class CalibrationError(CodecError, SpecError):
    """A head-sparse codec without a head ranking, or with one measured on another layout."""


MAX_RANKING_BYTES = 1 << 24
"""The largest head-ranking file read (a share per layer and KV head: kilobytes in practice)."""


@dataclass(frozen=True)
class HeadRanking:
    """Per layer and KV head, the share of attention placed beyond the recent window.

    Args:
        scores: ``[layers][kv_heads]`` shares in [0, 1] (higher: reaches further back).
        window: the recent window (tokens) the shares were measured beyond.
        source: what the calibration read (for the record).

    Raises CalibrationError for an empty or ragged table or a share outside [0, 1].
    """

    scores: tuple[tuple[float, ...], ...]
    window: int
    source: str = ""

    def __post_init__(self) -> None:
        rows = self.scores
        if not rows or not rows[0] or any(len(r) != len(rows[0]) for r in rows):
            raise CalibrationError("head ranking: scores must be a non-empty [layers][heads] table")
        try:
            if any(not 0.0 <= float(x) <= 1.0 for r in rows for x in r):
                raise CalibrationError("head ranking: every share must be in [0, 1]")
        except (TypeError, ValueError, OverflowError) as exc:  # not numbers; 10**400
            raise CalibrationError(f"head ranking: every share must be a number: {exc}") from None

    @property
    def num_layers(self) -> int:
        """Layers ranked."""
        return len(self.scores)

    @property
    def num_kv_heads(self) -> int:
        """KV heads per layer."""
        return len(self.scores[0])

    def order(self, layer: int) -> list[int]:
        """The layer's KV heads, highest share first (ties: lower index first)."""
        row = self.scores[layer]
        return sorted(range(len(row)), key=lambda h: (-row[h], h))

    def check(self, spec: KVSpec) -> None:
        """Raise CalibrationError when ``spec``'s layers or KV heads differ from the ranking's."""
        if (spec.num_layers, spec.num_kv_heads) != (self.num_layers, self.num_kv_heads):
            raise CalibrationError(
                f"head ranking of {self.num_layers} layers x {self.num_kv_heads} KV heads "
                f"cannot serve a spec of {spec.num_layers} x {spec.num_kv_heads}"
            )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (:meth:`from_dict` reads it)."""
        return {
            "scores": [list(r) for r in self.scores],
            "window": self.window,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Any) -> HeadRanking:
        """Read :meth:`to_dict`'s form. Raises CalibrationError for anything else."""
        try:
            rows = tuple(tuple(float(x) for x in r) for r in data["scores"])
            return cls(rows, int(data["window"]), str(data.get("source", "")))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # (window: Infinity)
            raise CalibrationError(f"not a head ranking: {exc}") from exc

    def save(self, path: str | Path) -> None:
        """Write the ranking as JSON (beside the model's spec)."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> HeadRanking:
        """Read :meth:`save`'s file. Raises CalibrationError for a file that is not one."""
        try:
            with open(path, "rb") as f:  # bounded: /dev/zero was read into memory for good
                raw = f.read(MAX_RANKING_BYTES + 1)
            data = None if len(raw) > MAX_RANKING_BYTES else json.loads(raw.decode("utf-8"))
        except (OSError, ValueError, RecursionError) as exc:  # (deep nesting: RecursionError)
            raise CalibrationError(
                f"cannot read a head ranking from {path}: {exc!r:.200}"
            ) from None
        if data is None:
            raise CalibrationError(f"{path} is over {MAX_RANKING_BYTES} bytes: not a head ranking")
        return cls.from_dict(data)


def _scales16(x: torch.Tensor, dim: int) -> torch.Tensor:
    """fp16 scales (keepdim over ``dim``) of fp32 ``x``: the smallest fp16 ``s`` with
    ``127 s >= amax``, positive. Raises CodecRangeError when it exceeds fp16's range."""
    amax = torch.maximum(-x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True))
    want = amax / QMAX
    if bool((want > _F16_MAX).any()):
        raise CodecRangeError(f"head-sparse: an amax above {QMAX * _F16_MAX:g} has no fp16 scale")
    s = want.half()
    low = (s.float() < want) | (s == 0)
    return torch.where(low, torch.nextafter(s, torch.tensor(float("inf"), dtype=s.dtype)), s)


class HeadSparseCodec(Codec):
    """``head-sparse`` (module docstring).

    Args:
        ranking: the model's :class:`HeadRanking` (required).
        keep: KV heads per layer kept in 16 bits (default 1); at most the head count.
        full: ``"fp16"`` or ``"bf16"``: the kept heads' dtype for fp32 pages.

    Raises:
        CalibrationError: no ranking.
        SpecError: ``keep`` not in [0, heads], ``full`` not fp16/bf16.
    """

    name: ClassVar[str] = "head-sparse"
    codec_id: ClassVar[int] = 6
    old_codec_ids: ClassVar[tuple[int, ...]] = (5,)  # earlier layouts (refused)
    needs_layers: ClassVar[bool] = True

    def __init__(
        self, ranking: HeadRanking | None = None, keep: int = 1, full: str = "fp16"
    ) -> None:
        if not isinstance(ranking, HeadRanking):
            raise CalibrationError(
                "head-sparse needs calibration data: HeadRanking.load(path) or "
                "tierkv.codecs.head_calibration.calibrate(model, ids)"
            )
        if (
            isinstance(keep, bool)
            or not isinstance(keep, int)
            or not 0 <= keep <= ranking.num_kv_heads
        ):
            raise SpecError(f"head-sparse: keep must be an int in [0, {ranking.num_kv_heads}]")
        if full not in ("fp16", "bf16"):
            raise SpecError(f"head-sparse: full must be 'fp16' or 'bf16', got {full!r}")
        self.ranking = ranking
        self.keep = keep
        self.group_size = keep  # (the header's G field)
        self._full = torch.float16 if full == "fp16" else torch.bfloat16
        self._orders = torch.tensor([ranking.order(layer) for layer in range(ranking.num_layers)])

    def __repr__(self) -> str:
        return f"HeadSparseCodec(keep={self.keep}, layers={self.ranking.num_layers})"

    # -- sizes --------------------------------------------------------------------------------
    def check_spec(self, spec: KVSpec) -> None:
        """SpecError for a page dtype it does not handle, CalibrationError for another layout."""
        super().check_spec(spec)
        self.ranking.check(spec)

    def full_dtype(self, spec: KVSpec) -> torch.dtype:
        """The kept heads' dtype: the page's when 16-bit, else ``full``."""
        return self.full_dtype_of(spec.dtype)

    def _meta_bytes(self, spec: KVSpec) -> int:
        return 4 + (spec.num_kv_heads + 3) // 4 * 4

    def scale_bytes(self, spec: KVSpec) -> int:
        """The layer and head order, then the int8 heads' fp16 scales (K per channel, V per
        token)."""
        rest = spec.num_kv_heads - self.keep
        return self._meta_bytes(spec) + 2 * rest * (spec.head_dim + spec.page_tokens)

    def payload_bytes(self, spec: KVSpec) -> int:
        """Kept heads at 2 bytes per element, the others at 1."""
        per_head = 2 * spec.page_tokens * spec.head_dim
        return per_head * (2 * self.keep + (spec.num_kv_heads - self.keep))

    # -- encode -------------------------------------------------------------------------------
    def _layers(self, layers: Sequence[int] | torch.Tensor | None, n: int) -> torch.Tensor:
        if layers is None:
            raise SpecError("head-sparse: encode needs each page's layer (layers=...)")
        got = torch.as_tensor(layers, dtype=torch.int64).flatten()
        if got.numel() != n:
            raise SpecError(f"head-sparse: {got.numel()} layers for {n} pages")
        if n and (int(got.min()) < 0 or int(got.max()) >= self.ranking.num_layers):
            raise SpecError(f"head-sparse: layers must be in [0, {self.ranking.num_layers})")
        return got

    def _check(self, x: torch.Tensor) -> None:
        amax = check_finite(x, self.name)
        if self.full_dtype_of(x.dtype) == torch.float16 and x.dtype == torch.float32:
            big = amax >= 65520.0
            if bool(big.any()):
                raise CodecRangeError(f"head-sparse: pages {bad_pages(big)} exceed float16's range")

    def full_dtype_of(self, dtype: torch.dtype) -> torch.dtype:
        """The kept heads' dtype for pages of ``dtype``."""
        return dtype if dtype in (torch.float16, torch.bfloat16) else self._full

    def _encode_into(self, x: Tensor, spec: KVSpec, out: Tensor, layers: Layers) -> Tensor:
        """Encode pages of the given ``layers`` (:meth:`Codec.encode` checked the rest).
        Raises SpecError for missing or bad ``layers``; nothing is written when it raises."""
        n, size = x.shape[0], self.encoded_bytes(spec)
        lay = self._layers(layers, n)
        self._check(x)
        h, k = spec.num_kv_heads, self.keep
        parts = self._cuts(spec)
        order = self._orders[lay]  # [N, H]
        idx = order.view(n, 1, h, 1, 1).expand(n, 2, h, spec.page_tokens, spec.head_dim)
        ranked = torch.gather(x, 2, idx)  # heads in rank order
        full = ranked[:, :, :k].to(self.full_dtype(spec))
        rest = ranked[:, :, k:].float()
        sk, sv = _scales16(rest[:, 0], -2), _scales16(rest[:, 1], -1)  # [N, H-k, 1, D], [.., T, 1]
        s = torch.stack([sk.expand_as(rest[:, 0]), sv.expand_as(rest[:, 1])], dim=1)
        q = torch.round(rest / s.float()).clamp_(-QMAX, QMAX).to(torch.int8)
        meta = torch.zeros(n, self._meta_bytes(spec), dtype=torch.uint8)
        meta[:, :4] = lay.to(torch.int32).view(n, 1).view(torch.uint8)
        meta[:, 4 : 4 + h] = order.to(torch.uint8)
        out[:, :HEADER_BYTES] = self.header(spec).to(out.device)
        out[:, parts[0] : parts[1]] = meta
        scales = torch.cat([sk.reshape(n, -1), sv.reshape(n, -1)], dim=1)
        out[:, parts[1] : parts[2]] = scales.view(torch.uint8)
        out[:, parts[2] : parts[3]] = full.contiguous().view(n, -1).view(torch.uint8)
        out[:, parts[3] : parts[4]] = q.contiguous().view(n, -1).view(torch.uint8)
        out[:, parts[4] : size] = 0
        return out

    def _cuts(self, spec: KVSpec) -> tuple[int, int, int, int, int]:
        h, k, t, d = spec.num_kv_heads, self.keep, spec.page_tokens, spec.head_dim
        a = HEADER_BYTES
        b = a + self._meta_bytes(spec)
        c = b + 2 * (h - k) * (d + t)
        e = c + 2 * 2 * k * t * d
        return a, b, c, e, e + 2 * (h - k) * t * d

    # -- decode -------------------------------------------------------------------------------
    def decode(
        self, data: torch.Tensor, spec: KVSpec, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Decode (see :meth:`Codec.decode`); the layer comes from each page.

        Raises SpecError, CalibrationError, CorruptEncodingError (a header, layer or head order
        that does not match the ranking, or a scale that is negative or not finite)."""
        size = self.encoded_bytes(spec)
        if data.dtype != torch.uint8 or data.dim() != 2:
            raise SpecError(f"data: expected [N, {size}] uint8, got {list(data.shape)}")
        if data.shape[1] < size:
            raise CorruptEncodingError(f"data: {data.shape[1]} bytes per page, need {size}")
        n, h, k, t, d = data.shape[0], spec.num_kv_heads, self.keep, spec.page_tokens, spec.head_dim
        a, b, c, e, f = self._cuts(spec)
        hdr = self.header(spec).to(data.device)
        bad = (data[:, :HEADER_BYTES] != hdr).any(dim=1)
        if bool(bad.any()):
            why = describe_mismatch(data[int(bad.nonzero()[0, 0])], hdr)
            raise CorruptEncodingError(f"pages {bad_pages(bad)}: header mismatch: {why}")
        lay = data[:, a : a + 4].contiguous().view(torch.int32).view(n).long()
        badl = (lay < 0) | (lay >= self.ranking.num_layers)
        if bool(badl.any()):
            raise CorruptEncodingError(f"pages {bad_pages(badl)}: layer out of range")
        order = data[:, a + 4 : a + 4 + h].long()
        bado = (order != self._orders[lay]).any(dim=1)
        if bool(bado.any()):
            raise CorruptEncodingError(f"pages {bad_pages(bado)}: head order is not the ranking's")
        s = data[:, b:c].contiguous().view(torch.float16).float()
        bads = ~(torch.isfinite(s) & (s >= 0)).all(dim=1)
        if bool(bads.any()):
            raise CorruptEncodingError(f"pages {bad_pages(bads)}: negative or non-finite scales")
        sk = s[:, : (h - k) * d].view(n, h - k, 1, d)
        sv = s[:, (h - k) * d :].view(n, h - k, t, 1)
        view = decode_target(out, n, spec, data.device)
        full = data[:, c:e].contiguous().view(self.full_dtype(spec)).view(n, 2, k, t, d)
        q = data[:, e:f].contiguous().view(torch.int8).view(n, 2, h - k, t, d).float()
        rest = torch.stack([q[:, 0] * sk, q[:, 1] * sv], dim=1)
        ranked = torch.cat([full.to(spec.dtype), rest.to(spec.dtype)], dim=2)
        idx = order.view(n, 1, h, 1, 1).expand(n, 2, h, t, d)
        view.scatter_(2, idx, ranked)
        return view

    # -- bounds -------------------------------------------------------------------------------
    def error_bound(
        self,
        pages: torch.Tensor,
        spec: KVSpec,
        layers: Sequence[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per element (module docstring), float64 ``[N, 2, H, T, D]``."""
        self.check_spec(spec)
        x = as_pages(pages, spec, "pages")
        n, h, k = x.shape[0], spec.num_kv_heads, self.keep
        lay = self._layers(layers, n)
        self._check(x)
        order = self._orders[lay]
        idx = order.view(n, 1, h, 1, 1).expand(n, 2, h, spec.page_tokens, spec.head_dim)
        ranked = torch.gather(x, 2, idx).double()
        if self.full_dtype(spec) == spec.dtype:
            kept = torch.zeros_like(ranked[:, :, :k])
        else:
            u, tiny = _ROUND[self.full_dtype(spec)]
            kept = torch.clamp(ranked[:, :, :k].abs() * u, min=tiny)
        rest = ranked[:, :, k:]
        sk, sv = _scales16(rest[:, 0].float(), -2), _scales16(rest[:, 1].float(), -1)
        s = torch.stack([sk.expand_as(rest[:, 0]), sv.expand_as(rest[:, 1])], dim=1).double()
        u, tiny = _ROUND[spec.dtype]
        low = s * _SLACK + u * (rest.abs() + s) + tiny
        bound = torch.empty_like(ranked)
        bound.scatter_(2, idx, torch.cat([kept, low], dim=2))
        return bound

    # (encode and decode are whole above: the base class's chunked kernels are not used)
    def _encode(self, x: torch.Tensor, scales: torch.Tensor, payload: torch.Tensor) -> None:
        raise SpecError("head-sparse encodes through encode(pages, spec, layers=...)")

    def _decode(self, scales: torch.Tensor, payload: torch.Tensor, out: torch.Tensor) -> None:
        raise SpecError("head-sparse decodes through decode(data, spec)")
