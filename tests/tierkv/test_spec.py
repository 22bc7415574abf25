import pytest
import torch

from tierkv import KVSpec, SpecError
from tierkv.spec import ALIGN, parse_dtype


def test_llama3_8b_layout() -> None:
    spec = KVSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="fp16", page_tokens=16)
    assert spec.kv_bytes == 8 * 16 * 128 * 2
    assert spec.page_bytes == 2 * spec.kv_bytes == 65536
    assert spec.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert spec.block_bytes == 32 * 65536
    assert spec.page_shape == (2, 8, 16, 128)
    assert spec.blocks_for(0) == 0
    assert spec.blocks_for(16) == 1
    assert spec.blocks_for(17) == 2
    assert spec.pages_for(100) == 7 * 32
    assert spec.bytes_for(100) == 7 * 32 * 65536


def test_pages_are_128_byte_aligned_and_padded() -> None:
    spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=3, dtype=torch.float16, page_tokens=5)
    assert spec.kv_bytes == 30
    assert spec.page_bytes == ALIGN
    assert spec.page_bytes % ALIGN == 0
    assert spec.page_elems * spec.itemsize <= spec.page_bytes


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"num_kv_heads": -1},
        {"head_dim": 1.5},
        {"page_tokens": True},
        {"dtype": "int7"},
        {"dtype": torch.int32},
    ],
)
def test_invalid_specs_raise_clear_errors(kwargs: dict) -> None:
    args = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "bf16", "page_tokens": 16}
    args.update(kwargs)
    with pytest.raises(SpecError) as info:
        KVSpec(**args)
    assert "KVSpec" in str(info.value) or "dtype" in str(info.value)


def test_round_trip_dict() -> None:
    spec = KVSpec(4, 2, 64, "bfloat16", 32)
    assert KVSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(SpecError):
        KVSpec.from_dict({"num_layers": 1})


def test_dtype_names() -> None:
    assert parse_dtype("torch.bfloat16") is torch.bfloat16
    assert parse_dtype("FP32") is torch.float32
    with pytest.raises(SpecError):
        KVSpec(1, 1, 1).blocks_for(-1)


def test_a_page_over_a_gib_is_a_spec_error() -> None:
    """An engine of page_tokens=10**9 (a careless unit) made 4 GB pages; its first append
    zeroed one and the kernel killed the process. Now KVSpec refuses pages over MAX_PAGE_BYTES
    (the largest real page is a few hundred MiB)."""
    from tierkv.spec import MAX_PAGE_BYTES

    with pytest.raises(SpecError, match="page_tokens"):
        KVSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="fp32", page_tokens=10**9)
    with pytest.raises(SpecError):
        KVSpec(num_layers=2, num_kv_heads=10**6, head_dim=10**6, dtype="fp32", page_tokens=1)
    big = KVSpec(num_layers=80, num_kv_heads=128, head_dim=256, dtype="fp32", page_tokens=1024)
    assert big.page_bytes <= MAX_PAGE_BYTES
