"""Content keys are made in tierkv.keys only: a live sequence's unpublished blocks chain to the
keys prefix_keys gives, page keys and is_content are defined there (and kept importable from
their old homes)."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import sequence
from tierkv.keys import (
    KEY_BYTES,
    PAGE_KEY_BYTES,
    block_key,
    is_content,
    page_key,
    prefix_keys,
    private_key,
    root_key,
    unpublished_keys,
)
from tierkv.sequence import SequenceState


@settings(max_examples=60, deadline=None)
@given(
    toks=st.lists(st.integers(0, 2**32 - 1), max_size=40),
    page_tokens=st.integers(1, 6),
    published=st.lists(st.booleans(), max_size=10),
    namespace=st.one_of(st.none(), st.text(max_size=5)),
)
def test_unpublished_keys_are_the_prefix_keys(
    toks: list[int], page_tokens: int, published: list[bool], namespace: str | None
) -> None:
    want = prefix_keys(toks, page_tokens, namespace)
    n = len(want)
    shared = [1 if i < len(published) and published[i] else 0 for i in range(n)]
    # published blocks carry their content key; the others a private key
    blocks = [want[i] if shared[i] else private_key("s", i) for i in range(n)]
    t = page_tokens
    got = list(unpublished_keys(namespace, blocks, shared, lambda i: toks[i * t : (i + 1) * t], n))
    assert got == [(i, want[i]) for i in range(n) if not shared[i]]
    assert list(unpublished_keys(namespace, blocks, shared, lambda i: [], 0)) == []


def test_a_sequence_names_its_full_blocks_as_prefix_keys_would() -> None:
    toks = list(range(100, 111))  # 11 tokens, 4 per block: two full blocks
    seq = SequenceState("a", 2, 4, "model", array("q", toks))
    for i in range(3):
        seq.append_block(private_key("a", i), shared=False)
    seq.set_all_kv_len(11)
    assert list(seq.unpublished()) == list(enumerate(prefix_keys(toks, 4, "model")))
    seq.set_all_kv_len(5)  # only block 0 has its KV in every layer
    assert [i for i, _ in seq.unpublished()] == [0]


def test_page_keys_and_content_kinds() -> None:
    block = block_key(root_key(), [1, 2, 3])
    page = page_key(block, 258)
    assert page == block + b"\x02\x01" and len(page) == PAGE_KEY_BYTES == KEY_BYTES + 2
    assert sequence.page_key is page_key  # the old import path still works
    assert is_content(block) and is_content(page)
    private = private_key("s", 0)
    assert not is_content(private) and not is_content(page_key(private, 0))
    assert not is_content(block[:8])
