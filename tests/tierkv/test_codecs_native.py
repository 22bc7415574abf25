"""The native int8 decode (tierkv/codecs/_dequant.c, tierkv.codecs.fast): bit-identical to the
torch path for every page dtype, per-channel and group scales (vector and scalar group widths),
subnormals, zeros and values near the dtype's limits; both its AVX-512 and portable paths; its
scale check agrees with torch's; layouts it does not take fall back to torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tierkv.codecs import CorruptEncodingError, create_codec, fast
from tierkv.codecs.header import HEADER_BYTES
from tierkv.spec import KVSpec

needs_native = pytest.mark.skipif(fast.ISA is None, reason="tierkv.codecs._dequant not built")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CODECS = [("int8", {}), ("int8-group", {"group_size": 32}), ("int8-group", {"group_size": 8})]


def _pages(spec: KVSpec, n: int = 23) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    mags = torch.logspace(-40, 4, n, dtype=torch.float64).float().view(n, 1, 1, 1, 1)
    x = torch.randn(n, *spec.page_shape, generator=gen) * mags
    info = torch.finfo(spec.dtype)
    x[1] = 0
    x[2, 0, 0, 0, :4] = torch.tensor([info.max, -info.max, info.tiny, -info.tiny / 4])
    return x.to(spec.dtype)


def _torch_decode(codec: object, blob: torch.Tensor, spec: KVSpec) -> torch.Tensor:
    with fast.torch_path():
        return codec.decode(blob, spec)  # type: ignore[attr-defined]


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "opts"), CODECS)
def test_native_decode_is_bit_identical_to_torch(dtype: torch.dtype, name: str, opts: dict) -> None:
    spec = KVSpec(2, 3, 64, dtype, 16)
    codec = create_codec(name, **opts)
    blob = codec.encode(_pages(spec), spec)
    got = codec.decode(blob, spec)
    want = _torch_decode(codec, blob, spec)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got.view(bits), want.view(bits))
    slots = torch.zeros(blob.shape[0], spec.page_bytes + 128, dtype=torch.uint8)  # strided out
    codec.decode(blob, spec, out=slots)
    assert torch.equal(slots[:, : 2 * spec.kv_bytes].view(bits).view(want.shape), want.view(bits))


@needs_native
def test_portable_path_is_bit_identical_too() -> None:
    code = (
        "import hashlib\nimport torch\ntorch.manual_seed(0)\n"
        "from tierkv.codecs import create_codec, fast\n"
        "from tierkv.spec import KVSpec\n"
        "assert fast.ISA == 'c', fast.ISA\n"
        "for dt in (torch.float32, torch.float16, torch.bfloat16):\n"
        "    spec = KVSpec(1, 2, 32, dt, 16)\n"
        "    c = create_codec('int8')\n"
        "    mags = torch.logspace(-30, 3, 9).view(9, 1, 1, 1, 1)\n"
        "    x = torch.randn(9, *spec.page_shape) * mags\n"
        "    blob = c.encode(x.to(dt), spec)\n"
        "    out = c.decode(blob, spec).contiguous().view(torch.uint8).numpy().tobytes()\n"
        "    print(hashlib.sha256(out).hexdigest())\n"
    )
    env = {**os.environ, "TIERKV_DEQUANT_PORTABLE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    portable = out.stdout.split()
    env.pop("TIERKV_DEQUANT_PORTABLE")
    code = code.replace("assert fast.ISA == 'c', fast.ISA\n", "")
    same = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert same.returncode == 0, same.stderr
    assert portable == same.stdout.split()


@needs_native
def test_scale_check_agrees_with_torch() -> None:
    spec = KVSpec(1, 2, 32, torch.float32, 16)
    codec = create_codec("int8")
    blob = codec.encode(_pages(spec, 6), spec)
    end = HEADER_BYTES + codec.scale_bytes(spec)
    for i, bad in enumerate([-1.0, float("nan"), float("inf"), -0.0, 0.0]):
        blob[i, HEADER_BYTES:end].view(torch.float32)[3] = bad
    sv = blob[:, HEADER_BYTES:end].view(torch.float32)
    want = ~(torch.isfinite(sv) & (sv >= 0)).all(dim=1)
    assert torch.equal(fast.bad_scales(blob[:, HEADER_BYTES:end]), want)
    assert want.tolist() == [True, True, True, False, False, False]
    with pytest.raises(CorruptEncodingError, match="pages 0, 1, 2"):
        codec.decode(blob, spec)


def test_layouts_it_does_not_take_fall_back() -> None:
    spec = KVSpec(1, 2, 32, torch.float32, 16)
    scales = torch.zeros(2, 4 * 2 * 2 * 32, dtype=torch.uint8)
    payload = torch.zeros(2, 2 * 2 * 16 * 32, dtype=torch.uint8)
    out = torch.empty(2, *spec.page_shape).transpose(3, 4)  # pages not contiguous
    assert not fast.dequant(scales, payload, out, 0)
    assert not fast.dequant(scales[:, :8], payload, torch.empty(2, *spec.page_shape), 0)
    assert not fast.dequant(scales, payload, torch.empty(2, *spec.page_shape).half(), 3)
