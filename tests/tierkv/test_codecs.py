"""Cold-page codecs: round trips, stated bounds (hypothesis), sizes, batching, bad inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tierkv.codecs import (
    CODECS,
    CodecError,
    CodecRangeError,
    CorruptPageError,
    Int8GroupCodec,
    NonFiniteError,
    UnknownCodecError,
    codec_for,
    create_codec,
)
from tierkv.codecs.header import HEADER_BYTES
from tierkv.errors import SpecError
from tierkv.spec import KVSpec

FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LOSSY = ("fp16", "bf16", "int8", "int8-group")
F32_MAX = float(np.finfo(np.float32).max)
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make(name: str, group: int = 2):
    return create_codec(name, group_size=group) if name == "int8-group" else create_codec(name)


def to_dtype(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """fp32 values -> ``dtype``, clamped to its finite range first."""
    fmax = torch.finfo(dtype).max
    return torch.from_numpy(a).clamp(-fmax, fmax).to(dtype)


@st.composite
def cases(draw, dtypes=FLOATS):
    """(spec, pages, group): random geometry, values from subnormal to the dtype's max."""
    dtype = draw(st.sampled_from(dtypes))
    group = draw(st.sampled_from([1, 2, 4, 8]))
    spec = KVSpec(
        num_layers=1,
        num_kv_heads=draw(st.integers(1, 3)),
        head_dim=group * draw(st.integers(1, 3)),
        dtype=dtype,
        page_tokens=draw(st.integers(1, 6)),
    )
    n = draw(st.integers(1, 3))
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    elems = st.one_of(
        st.floats(width=32, allow_nan=False, allow_infinity=False),
        st.floats(-2.0, 2.0, width=32),
        st.sampled_from([0.0, -0.0, tiny, -3 * tiny, 65504.0, F32_MAX, -F32_MAX, 1e-30]),
    )
    kind = draw(st.sampled_from(["mixed", "zeros", "constant", "scaled"]))
    shape = (n, *spec.page_shape)
    if kind == "zeros":
        a = np.zeros(shape, np.float32)
    elif kind == "constant":
        a = np.full(shape, draw(elems), np.float32)
    else:
        a = draw(arrays(np.float32, shape, elements=elems))
        if kind == "scaled":  # one magnitude per page: huge or tiny, not mixed
            scale = np.float32(2.0) ** draw(st.integers(-140, 120))
            a = (np.clip(a, -2, 2) * scale).astype(np.float32)
    return spec, to_dtype(a, dtype), group


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@PROPS
@given(cases(), st.sampled_from(["none", "fp16", "bf16"]), st.booleans())
def test_lossless_paths_are_bit_exact(case, name, with_specials):
    spec, x, _ = case
    codec = make(name)
    if name != "none" and spec.dtype != codec.target:  # type: ignore[attr-defined]
        return
    if with_specials and name == "none":
        x.view(-1)[:2] = torch.tensor([float("nan"), float("-inf")], dtype=spec.dtype)
    assert same_bits(codec.decode(codec.encode(x, spec), spec), x)
    assert float(codec.error_bound(x, spec).max()) == 0.0


def test_identity_carries_fp8():
    spec = KVSpec(1, 2, 8, torch.float8_e4m3fn, 4)
    x = torch.randn(3, *spec.page_shape).to(torch.float8_e4m3fn)
    codec = create_codec("identity")
    assert same_bits(codec.decode(codec.encode(x, spec), spec), x)


@PROPS
@given(cases(), st.sampled_from(LOSSY))
def test_lossy_bound_holds(case, name):
    spec, x, group = case
    codec = make(name, group)
    try:
        data = codec.encode(x, spec)
    except CodecRangeError:  # only a downcast to a narrower range may refuse
        assert name in ("fp16", "bf16")
        assert float(x.double().abs().max()) >= 65520.0
        return
    y = codec.decode(data, spec)
    assert bool(torch.isfinite(y).all())
    err = (y.double() - x.double()).abs()
    assert bool((err <= codec.error_bound(x, spec)).all())


@PROPS
@given(cases(), st.sampled_from(["int8", "int8-group"]))
def test_int8_error_is_half_a_scale_before_the_final_rounding(case, name):
    """The issue's bound: |q*s - x| <= s/2 (+ 2^-16 s of fp32 slack), read from the bytes."""
    spec, x, group = case
    codec = make(name, group)
    data = codec.encode(x, spec)
    s_end = HEADER_BYTES + codec.scale_bytes(spec)
    s = data[:, HEADER_BYTES:s_end].view(torch.float32).double()
    q = data[:, s_end : s_end + spec.page_elems].view(torch.int8).double()
    n, two, h, t, d = x.shape
    if name == "int8":
        s = s.view(n, two, h, 1, d)
        xs = x.double()
    else:
        s = s.view(n, two, h, t, d // group, 1)
        xs, q = x.double().view(*s.shape[:-1], group), q.view(*s.shape[:-1], group)
    assert bool((q.abs() <= 127).all()) and bool((s >= 0).all())
    assert bool(((q.view(xs.shape) * s - xs).abs() <= s * (0.5 + 2.0**-16)).all())


@PROPS
@given(
    st.sampled_from([(torch.float32, "fp16"), (torch.float32, "bf16"), (torch.float16, "bf16")]),
    st.lists(st.floats(2.0**-14, 60000.0, width=32), min_size=1, max_size=64),
)
def test_downcast_relative_error_in_normal_range(pair, values):
    src, name = pair
    spec = KVSpec(1, 1, len(values), src, 1)
    x = torch.tensor(values).to(src).view(1, 1, 1, 1, -1).repeat(1, 2, 1, 1, 1)
    codec = create_codec(name)
    y = codec.decode(codec.encode(x, spec), spec).double()
    u = 2.0**-11 if name == "fp16" else 2.0**-8
    assert bool(((y - x.double()).abs() <= u * x.double().abs()).all())


def test_sizes_and_compression_ratios():
    spec16 = KVSpec(32, 8, 128, torch.float16, 16)
    spec32 = KVSpec(32, 8, 128, torch.float32, 16)
    elems = spec16.page_elems
    for name in ("int8", "int8-group"):
        codec = make(name, 32)
        scales = codec.scale_bytes(spec16)
        assert codec.payload_bytes(spec16) == spec16.page_bytes // 2  # one byte, not two
        assert codec.encoded_bytes(spec16) == -(-(HEADER_BYTES + elems + scales) // 128) * 128
        assert codec.encoded_bytes(spec16) % 128 == 0
    assert make("int8").scale_bytes(spec16) == 4 * 2 * 8 * 128
    assert make("int8-group", 32).scale_bytes(spec16) == 4 * 2 * 8 * 16 * 4
    assert 1.5 < make("int8").compression_ratio(spec16) < 2.0
    assert 1.75 < make("int8-group", 32).compression_ratio(spec16) < 2.0
    assert 1.9 < create_codec("fp16").compression_ratio(spec32) <= 2.0
    assert create_codec("none").encoded_bytes(spec16) == spec16.page_bytes + 128


# codecs built without options (head-sparse needs its calibration: test_codecs_head_sparse.py)
PLAIN = sorted(set(CODECS) - {"head-sparse"})


@pytest.mark.parametrize("name", PLAIN)
@pytest.mark.parametrize("dtype", FLOATS)
def test_batch_equals_single_and_bytes_are_self_contained(name, dtype):
    spec = KVSpec(1, 2, 64, dtype, 8)
    codec = make(name, 16)
    x = (torch.randn(5, *spec.page_shape) * torch.logspace(-3, 3, 64)).to(dtype)
    batch = codec.encode(x, spec)
    singles = torch.cat([codec.encode(x[i : i + 1], spec) for i in range(5)])
    assert torch.equal(batch, singles)
    shipped = torch.frombuffer(bytearray(batch.numpy().tobytes()), dtype=torch.uint8)
    shipped = shipped.view(5, -1)  # as if another process received the bytes
    other = codec_for(shipped)
    assert type(other) is type(codec) and other.group_size == codec.group_size
    y = other.decode(shipped, spec)
    assert same_bits(y, torch.cat([codec.decode(batch[i : i + 1], spec) for i in range(5)]))


@pytest.mark.parametrize("name", ["none", "fp16", "int8", "int8-group"])
def test_uint8_slots_in_and_out(name):
    spec = KVSpec(1, 3, 40, torch.float16, 5)  # 2*3*5*40*2 = 2400 bytes -> 2432 padded
    codec = make(name, 8)
    x = torch.randn(4, *spec.page_shape, dtype=torch.float16)
    slots = torch.zeros(4, spec.page_bytes, dtype=torch.uint8)
    slots[:, : 2 * spec.kv_bytes] = x.view(4, -1).view(torch.uint8)
    wide = torch.full((4, codec.encoded_bytes(spec) + 100), 7, dtype=torch.uint8)
    codec.encode(slots, spec, out=wide)
    assert torch.equal(wide[:, : codec.encoded_bytes(spec)], codec.encode(x, spec))
    assert bool((wide[:, codec.encoded_bytes(spec) :] == 7).all())
    back = torch.full((4, spec.page_bytes), 9, dtype=torch.uint8)
    view = codec.decode(wide, spec, out=back)
    assert same_bits(view, codec.decode(wide, spec))
    assert bool((back[:, 2 * spec.kv_bytes :] == 0).all())  # padding zeroed


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_is_rejected_and_out_untouched(name, bad):
    spec = KVSpec(1, 1, 8, torch.float32, 2)
    codec = make(name)
    x = torch.ones(3, *spec.page_shape)
    x[2, 1, 0, 1, 3] = bad
    out = torch.full((3, codec.encoded_bytes(spec)), 5, dtype=torch.uint8)
    with pytest.raises(NonFiniteError, match="pages 2"):
        codec.encode(x, spec, out=out)
    assert bool((out == 5).all())


def test_downcast_overflow_raises_or_saturates():
    spec = KVSpec(1, 1, 4, torch.float32, 1)
    x = torch.tensor([70000.0, -1e30, 1.0, 65519.0]).view(1, 1, 1, 1, 4).repeat(1, 2, 1, 1, 1)
    with pytest.raises(CodecRangeError, match="saturate=True"):
        create_codec("fp16").encode(x, spec)
    sat = create_codec("fp16", saturate=True)
    y = sat.decode(sat.encode(x, spec), spec)
    assert y[0, 0, 0, 0].tolist() == [65504.0, -65504.0, 1.0, 65504.0]
    assert bool(((y.double() - x.double()).abs() <= sat.error_bound(x, spec)).all())
    bf = KVSpec(1, 1, 4, torch.float16, 1)
    xh = torch.tensor([65504.0, -65504.0, 65300.0, 1.0], dtype=torch.float16).view(1, 1, 1, 1, 4)
    xh = xh.repeat(1, 2, 1, 1, 1)  # 65504 rounds to 65536 in bf16: decode must stay finite
    yh = create_codec("bf16").decode(create_codec("bf16").encode(xh, bf), bf)
    assert bool(torch.isfinite(yh).all())


def test_wrong_shapes_dtypes_and_options_raise_spec_error():
    spec = KVSpec(1, 2, 8, torch.float16, 4)
    codec = create_codec("int8")
    with pytest.raises(SpecError, match="expected"):
        codec.encode(torch.zeros(2, 2, 2, 4, 9, dtype=torch.float16), spec)
    with pytest.raises(SpecError, match="dtype"):
        codec.encode(torch.zeros(2, *spec.page_shape), spec)
    with pytest.raises(SpecError, match="cannot hold"):
        codec.encode(torch.zeros(2, 10, dtype=torch.uint8), spec)
    with pytest.raises(SpecError, match="does not handle"):
        x8 = torch.zeros(1, 2, 2, 4, 8).to(torch.float8_e4m3fn)
        codec.encode(x8, KVSpec(1, 2, 8, "fp8", 4))
    with pytest.raises(SpecError, match="does not divide"):
        create_codec("int8-group", group_size=3).encoded_bytes(spec)
    with pytest.raises(SpecError):
        create_codec("int8-group", group_size=0)
    with pytest.raises(SpecError):
        create_codec("int8", group_size=4)
    with pytest.raises(UnknownCodecError) as info:
        create_codec("zstd")
    assert isinstance(info.value, KeyError) and isinstance(info.value, CodecError)
    data = codec.encode(torch.zeros(2, *spec.page_shape, dtype=torch.float16), spec)
    with pytest.raises(SpecError):
        codec.decode(data.view(torch.int8), spec)
    with pytest.raises(SpecError):
        codec.decode(data, spec, out=torch.zeros(3, *spec.page_shape, dtype=torch.float16))
    with pytest.raises(SpecError):
        codec.encode(torch.zeros(2, *spec.page_shape, dtype=torch.float16), spec, out=data[:1])


def test_corrupt_and_short_buffers_raise_corrupt_page_error():
    spec = KVSpec(1, 2, 8, torch.float16, 4)
    codec = create_codec("int8")
    data = codec.encode(torch.randn(3, *spec.page_shape).half(), spec)
    with pytest.raises(CorruptPageError, match="need"):
        codec.decode(data[:, :100], spec)
    bad = data.clone()
    bad[1, 0] ^= 0xFF
    with pytest.raises(CorruptPageError, match="pages 1: header mismatch: magic"):
        codec.decode(bad, spec)
    with pytest.raises(CorruptPageError, match="codec_id"):
        create_codec("int8-group", group_size=4).decode(data, spec)
    with pytest.raises(CorruptPageError, match="page_tokens=4 \\(expected 2\\)"):
        codec.decode(data, KVSpec(1, 2, 8, torch.float16, 2))  # fewer bytes: a spec mismatch
    bad = data.clone()
    bad[2, HEADER_BYTES : HEADER_BYTES + 4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)
    with pytest.raises(CorruptPageError, match="pages 2: negative or non-finite"):
        codec.decode(bad, spec)  # a NaN scale
    with pytest.raises(CorruptPageError):
        codec_for(torch.zeros(64, dtype=torch.uint8))
    bad = data.clone()
    bad[0, 5] = 99
    with pytest.raises(UnknownCodecError):
        codec_for(bad)


def test_registry_names_round_trip():
    spec = KVSpec(1, 1, 32, torch.float32, 2)
    x = torch.randn(2, *spec.page_shape)
    for name in PLAIN:
        codec = create_codec(name)
        y = codec.decode(codec.encode(x, spec), spec)
        assert bool(((y.double() - x.double()).abs() <= codec.error_bound(x, spec)).all())
    assert isinstance(create_codec("INT8-GROUP", group_size=8), Int8GroupCodec)


@pytest.mark.parametrize("name", ["fp16", "int8", "int8-group"])
def test_chunked_batches_match_and_name_global_pages(name):
    spec = KVSpec(1, 2, 32, torch.float32, 4)
    codec = make(name, 8)
    x = torch.randn(7, *spec.page_shape)
    whole = codec.encode(x, spec)
    codec.chunk_bytes = 2 * spec.page_bytes  # type: ignore[misc]  # chunks of 2 pages
    assert torch.equal(codec.encode(x, spec), whole)
    assert same_bits(
        codec.decode(whole, spec),
        create_codec(name, **({"group_size": 8} if name == "int8-group" else {})).decode(
            whole, spec
        ),
    )
    x[5, 0, 1, 2, 3] = float("nan")
    out = whole.clone()
    with pytest.raises(NonFiniteError, match="pages 5 "):
        codec.encode(x, spec, out=out)
    assert torch.equal(out, whole)  # checked before the first chunk is written


@pytest.mark.parametrize("name", ["int8", "fp16", "identity"])
def test_a_codec_given_no_tensor_or_no_spec_is_a_typed_error(name: str) -> None:
    """encode([1, 2]), decode([1]) and encoded_bytes(None) were AttributeErrors from inside;
    now InvalidTypeError (also a SpecError)."""
    from tierkv.codecs import create_codec
    from tierkv.errors import InvalidTypeError, SpecError

    spec = KVSpec(2, 2, 8, torch.float32, 4)
    codec = create_codec(name)
    for call in (
        lambda: codec.encode([1, 2], spec),  # type: ignore[arg-type]
        lambda: codec.decode([1], spec),  # type: ignore[arg-type]
        lambda: codec.encoded_bytes(None),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidTypeError) as info:
            call()
        assert isinstance(info.value, SpecError)
