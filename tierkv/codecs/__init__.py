"""Cold-page codecs: one interface, five codecs, a registry.

>>> from tierkv.codecs import create_codec
>>> codec = create_codec("int8-group", group_size=32)
>>> blob = codec.encode(pages, spec)          # [N, codec.encoded_bytes(spec)] uint8
>>> back = codec.decode(blob, spec)           # [N, 2, H, T, D] in spec.dtype

=============  ===========================================  =======================
name           what                                         options
=============  ===========================================  =======================
``none``       the page bytes, lossless (alias ``identity``)  -
``fp16``       downcast to float16                          ``saturate=False``
``bf16``       downcast to bfloat16                         ``saturate=False``
``int8``       int8, one fp32 scale per (K/V, head, channel)  -
``int8-group`` int8, one fp32 scale per G elements of a head  ``group_size=32``
``head-sparse`` a layer's top KV heads fp16, the rest int8    ``ranking=``, ``keep=1``
=============  ===========================================  =======================

Layouts are drawn in :mod:`tierkv.codecs.header`, bounds stated in :mod:`.downcast` and
:mod:`.int8`, and both are collected in ``docs/codecs.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierkv.codecs.base import (
    Codec,
    CodecError,
    CodecRangeError,
    CorruptEncodingError,
    NonFiniteError,
    UnknownCodecError,
)
from tierkv.codecs.downcast import Bf16Codec, DowncastCodec, Fp16Codec, IdentityCodec
from tierkv.codecs.head_sparse import CalibrationError, HeadRanking, HeadSparseCodec
from tierkv.codecs.header import HEADER_BYTES, MAGIC, VERSION, unpack_header
from tierkv.codecs.int8 import Int8Codec, Int8GroupCodec
from tierkv.errors import CorruptPageError, SpecError
from tierkv.transports.deprecation import deprecated_alias
from tierkv.transports.named import Registry

__all__ = [
    "CODECS",
    "Bf16Codec",
    "CalibrationError",
    "Codec",
    "CodecError",
    "CodecRangeError",
    "CorruptEncodingError",
    "CorruptPageError",
    "DowncastCodec",
    "Fp16Codec",
    "HeadRanking",
    "HeadSparseCodec",
    "IdentityCodec",
    "Int8Codec",
    "Int8GroupCodec",
    "NonFiniteError",
    "UnknownCodecError",
    "codec_for",
    "create_codec",
    "get_codec",
]

CODECS: Registry[Codec] = Registry(
    "codec",
    error=UnknownCodecError,
    misuse=SpecError,
    builtins={
        "none": IdentityCodec,
        "identity": IdentityCodec,
        "fp16": Fp16Codec,
        "bf16": Bf16Codec,
        "int8": Int8Codec,
        "int8-group": Int8GroupCodec,
        "head-sparse": HeadSparseCodec,
    },
    result=Codec,
    fold_case=True,
)
"""Codec factories by name (case-insensitive); :func:`create_codec` passes options through,
``CODECS.register(name, factory)`` adds one."""

_BY_ID: dict[int, Callable[..., Codec]] = {
    c.codec_id: c for c in (IdentityCodec, Fp16Codec, Bf16Codec, Int8Codec, Int8GroupCodec)
}


def create_codec(name: str, **options: Any) -> Codec:
    """Return a new codec named ``name`` (see :data:`CODECS`), built with ``options``.

    Raises:
        UnknownCodecError: no codec of that name.
        SpecError: an option the codec does not take, or a bad value for one.
    """
    factory = CODECS.factory(name)
    try:
        made = factory(**options)
    except TypeError as exc:
        raise SpecError(f"codec {name!r}: {exc}") from exc
    if not isinstance(made, Codec):
        raise UnknownCodecError(f"codec factory for {name!r} returned {type(made).__name__}")
    return made


get_codec = deprecated_alias(create_codec, "get_codec")


def codec_for(data: torch.Tensor) -> Codec:
    """The codec that wrote the encoded page(s) ``data`` (``[L]`` or ``[N, L]`` uint8), read
    from the first page's header; :meth:`Codec.decode` then checks every header.

    Raises:
        CorruptEncodingError: shorter than a header, bad magic or version.
        UnknownCodecError: a codec id that no codec here has.
        CalibrationError: a head-sparse page (it needs its model's ranking).
        CorruptEncodingError: a page of head-sparse's earlier layout (codec id 5), which no
            codec here decodes.
    """
    row = data if data.dim() == 1 else data[0]
    if row.dtype != torch.uint8 or row.numel() < HEADER_BYTES:
        raise CorruptEncodingError(f"not an encoded page: {list(data.shape)} {data.dtype}")
    h = unpack_header(row)
    if h["magic"] != MAGIC or h["version"] != VERSION:
        raise CorruptEncodingError(
            f"not an encoded page: magic {h['magic']!r} version {h['version']}"
        )
    cid = h["codec_id"]
    if cid in HeadSparseCodec.old_codec_ids:
        raise CorruptEncodingError(
            f"codec id {cid}: an earlier head-sparse layout (a scale per channel of V), no "
            "longer decoded: re-encode the pages"
        )
    if cid == HeadSparseCodec.codec_id:
        raise CalibrationError(
            "head-sparse pages decode with their model's ranking: create_codec('head-sparse', "
            "ranking=HeadRanking.load(...), keep=...)"
        )
    if not isinstance(cid, int) or cid not in _BY_ID:
        raise UnknownCodecError(f"unknown codec id {cid} in page header")
    if cid == Int8GroupCodec.codec_id:
        return _BY_ID[cid](group_size=h["group_size"])
    return _BY_ID[cid]()
