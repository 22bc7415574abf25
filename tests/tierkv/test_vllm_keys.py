"""tierkv.integrations.vllm without vLLM: config checks, keys (stable across processes, the
model and the layout in them), and the clear error where vLLM is missing."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from tierkv.errors import InvalidInputError, InvalidTypeError
from tierkv.integrations import vllm as tv
from tierkv.integrations.vllm.config import Field, check_options
from tierkv.keys import is_content


def spec(**over: Any) -> Any:
    """Stands in for vLLM's OffloadingSpec: the fields `layout_fields` reads."""
    model = {"name": "org/model-a", "dtype": "float16", **over.pop("model", {})}
    parallel = {"tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1}
    parallel.update(over.pop("parallel", {}))
    group = SimpleNamespace(tokens_per_block=16, layer_names=("l0", "l1"), group_id=0)
    config = SimpleNamespace(
        model=SimpleNamespace(**model),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=over.pop("bpc", 8)),
        groups=(group,),
        worker_kv_bytes_per_block=65536,
        parallel=SimpleNamespace(**parallel),
        replicated_layout=False,
        canonical_layout=False,
        kv_cache_layout=None,
    )
    return SimpleNamespace(config=config)


def keys_of(s: Any, chunk: int = 1 << 19) -> tv.PageKeys:
    return tv.PageKeys(tv.layout_digest(tv.layout_fields(s, chunk)))


OFFLOAD_KEY = bytes(range(32)) + (0).to_bytes(4, "big")


def test_keys_are_content_keys_of_16_bytes() -> None:
    k = keys_of(spec())(OFFLOAD_KEY)
    assert len(k) == 16 and is_content(k)
    assert keys_of(spec())(OFFLOAD_KEY) == k  # deterministic


@pytest.mark.parametrize(
    "other",
    [
        {"model": {"name": "org/model-b"}},
        {"model": {"dtype": "bfloat16"}},
        {"parallel": {"tp_size": 2}},
        {"bpc": 4},
    ],
)
def test_another_model_or_layout_never_shares_a_key(other: dict[str, Any]) -> None:
    assert keys_of(spec(**other))(OFFLOAD_KEY) != keys_of(spec())(OFFLOAD_KEY)


def test_another_chunk_size_or_group_never_shares_a_key() -> None:
    assert keys_of(spec(), 1 << 20)(OFFLOAD_KEY) != keys_of(spec())(OFFLOAD_KEY)
    group1 = OFFLOAD_KEY[:-4] + (1).to_bytes(4, "big")
    assert keys_of(spec())(group1) != keys_of(spec())(OFFLOAD_KEY)


def test_keys_are_stable_across_processes() -> None:
    """Another interpreter (another hash seed) computes the same key: no Python hash()."""
    code = (
        "import sys; sys.path.insert(0, 'tests/tierkv'); "
        "from test_vllm_keys import keys_of, spec, OFFLOAD_KEY; "
        "print(keys_of(spec())(OFFLOAD_KEY).hex())"
    )
    env = {"PYTHONHASHSEED": "12345"}
    import os

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )  # fmt: skip
    assert out.stdout.strip() == keys_of(spec())(OFFLOAD_KEY).hex()


FIELDS = {
    "path": Field((str,)),
    "size": Field((int,), 1, minimum=1),
    "ratio": Field((float,), 1.0),
    "flag": Field((bool,), False),
    "ttl": Field((float, type(None)), None),
}


def test_check_options_fills_defaults_and_takes_ints_for_floats() -> None:
    got = check_options("t", {"path": "/x", "ratio": 2}, FIELDS)
    assert got == {"path": "/x", "size": 1, "ratio": 2, "flag": False, "ttl": None}


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        (
            {"path": "/x", "colour": 1},
            tv.VllmTierConfigError,
            r"unknown config field\(s\) \['colour'\]",
        ),
        ({}, tv.VllmTierConfigError, "'path' is required"),
        ({"path": 3}, tv.VllmTierTypeError, "'path' must be str, got int"),
        ({"path": "/x", "size": True}, tv.VllmTierTypeError, "'size' must be int"),
        ({"path": "/x", "size": 1.5}, tv.VllmTierTypeError, "'size' must be int"),
        ({"path": "/x", "size": 0}, tv.VllmTierConfigError, "'size' must be >= 1"),
        ({"path": "/x", "flag": 1}, tv.VllmTierTypeError, "'flag' must be bool"),
        ({"path": "/x", "ttl": "5"}, tv.VllmTierTypeError, "'ttl' must be float or None"),
        ({"path": "/x", "ttl": float("nan")}, tv.VllmTierConfigError, "'ttl' must be a finite"),
        ({"path": "/x", "ratio": float("inf")}, tv.VllmTierConfigError, "'ratio' must be a fin"),
        ({"path": "/x", "ratio": -float("inf")}, tv.VllmTierConfigError, "'ratio' must be a fi"),
    ],
)
def test_bad_options_are_typed_errors(
    options: dict[str, Any], error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words):
        check_options("t", options, FIELDS)


def test_error_kinds() -> None:
    assert issubclass(tv.VllmTierConfigError, InvalidInputError)
    assert issubclass(tv.VllmTierTypeError, InvalidTypeError)
    assert issubclass(tv.VllmTierTypeError, TypeError)


@pytest.mark.skipif(tv.AVAILABLE, reason="vLLM is installed here")
def test_without_vllm_building_a_tier_says_what_to_install() -> None:
    with pytest.raises(tv.VllmUnavailableError, match="pip install --no-deps vllm"):
        tv.TierKVDiskTier(None, memoryview(b""), "t")
