import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tierkv import SpecError, prefix_keys
from tierkv.keys import KeyKind, block_key, key_kind, private_key, root_key

TOKENS = list(range(1000, 1100))

_SCRIPT = (
    "from tierkv.keys import prefix_keys, private_key;"
    "print(','.join(k.hex() for k in prefix_keys(list(range(1000, 1100)), 16, 'm')),"
    " private_key('seq-1', 3).hex())"
)


def test_keys_are_chained_16_bytes() -> None:
    keys = prefix_keys(TOKENS, 16, namespace="model-a")
    assert len(keys) == 100 // 16
    assert all(len(k) == 16 for k in keys)
    assert len(set(keys)) == len(keys)
    # a key names the whole prefix: same block tokens after a different prefix -> different key
    other = prefix_keys([7] * 16 + TOKENS[16:], 16, namespace="model-a")
    assert other[1] != keys[1]
    # a shared prefix gives shared keys
    assert prefix_keys(TOKENS[:50] + [1, 2, 3] * 20, 16, namespace="model-a")[:3] == keys[:3]


def test_namespace_and_extras_separate_keys() -> None:
    a = prefix_keys(TOKENS, 16, namespace="model-a")
    b = prefix_keys(TOKENS, 16, namespace="model-b")
    assert not set(a) & set(b)
    c = prefix_keys(TOKENS, 16, namespace="model-a", extras=["lora-1"] * 6)
    assert not set(a) & set(c)


def test_input_types_agree() -> None:
    ref = prefix_keys(TOKENS, 16)
    assert prefix_keys(np.array(TOKENS, dtype=np.int32), 16) == ref
    assert prefix_keys(torch.tensor(TOKENS), 16) == ref
    parent = root_key(None)
    assert block_key(parent, TOKENS[:16]) == ref[0]


def test_private_keys_never_look_like_content() -> None:
    assert key_kind(private_key("s", 0)) is KeyKind.PRIVATE
    assert private_key("s", 0) != private_key("s", 1) != private_key("t", 0)
    assert all(key_kind(k) is KeyKind.CONTENT for k in prefix_keys(TOKENS, 4))


def test_bad_inputs() -> None:
    with pytest.raises(SpecError):
        prefix_keys(TOKENS, 0)
    with pytest.raises(SpecError):
        block_key(b"short", TOKENS[:4])
    with pytest.raises(SpecError):
        block_key(root_key(), np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(SpecError):
        block_key(root_key(), [0.5, 1.5])
    with pytest.raises(SpecError):
        key_kind(b"x")
    with pytest.raises(SpecError):
        prefix_keys(TOKENS, 16, extras=["a"])


def test_keys_identical_across_processes_and_hash_seeds() -> None:
    outs = []
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run(
            [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.append(res.stdout.strip())
    assert outs[0] == outs[1]
    here = ",".join(k.hex() for k in prefix_keys(TOKENS, 16, "m"))
    assert outs[0] == f"{here} {private_key('seq-1', 3).hex()}"


@pytest.mark.parametrize("page_tokens", [1.5, "4", True, None])
def test_page_tokens_of_another_type_is_a_spec_error(page_tokens: object) -> None:
    """prefix_keys([1, 2, 3], 1.5) was a TypeError of a slice; now SpecError."""
    from tierkv import SpecError, prefix_keys

    with pytest.raises(SpecError, match="page_tokens"):
        prefix_keys([1, 2, 3], page_tokens)  # type: ignore[arg-type]
