"""A step group's page names (tierkv.step_plan.group_pages, each sequence's block keys read
once for the group's layers) are those of the pages' own keys, block by block and layer by
layer (tierkv.keys.page_key): the pages read, the new ones, what each append fills and writes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.keys import page_key
from tierkv.sequence import SequenceState
from tierkv.step_plan import group_pages, step_order, written_keys

LAYERS = 4
LENGTHS = st.lists(st.integers(0, 40), min_size=LAYERS, max_size=LAYERS)  # KV per layer


def _reference(
    seqs: list[SequenceState], tokens: list[int], layers: list[int], t: int
) -> tuple[object, ...]:
    keys: list[bytes] = []
    new: list[bytes] = []
    plans = []
    for layer in layers:
        at, at_new = len(keys), len(new)
        starts, counts, filled = [], [], []
        for seq, k in zip(seqs, tokens):
            start = seq.kv_len_of(layer)
            have, need = -(-start // t), -(-(start + k) // t)
            keys += [page_key(seq.block(b), layer) for b in range(have)]
            new += [page_key(seq.block(b), layer) for b in range(have, need)]
            filled += [page_key(seq.block(b), layer) for b in range(start // t, (start + k) // t)]
            starts.append(start)
            counts.append(need)
        plans.append((at, at_new, starts, counts, filled, written_keys(seqs, tokens, layer)))
    return keys, new, plans


@settings(max_examples=200, deadline=None)
@given(
    t=st.sampled_from([1, 4, 16]),
    rows=st.lists(
        st.tuples(LENGTHS, st.integers(0, 9)),
        min_size=1,
        max_size=4,
    ),
    layers=st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS, unique=True),
)
def test_group_pages_names_the_pages_by_their_keys(
    t: int, rows: list[tuple[list[int], int]], layers: list[int]
) -> None:
    seqs, tokens = _sequences(t, rows)
    assert group_pages(seqs, tokens, layers, t) == _reference(seqs, tokens, layers, t)


@settings(max_examples=200, deadline=None)
@given(
    t=st.sampled_from([1, 4, 16]),
    rows=st.lists(st.tuples(LENGTHS, st.integers(0, 9)), min_size=1, max_size=4),
    layers=st.lists(st.integers(0, LAYERS - 1), min_size=1, max_size=LAYERS, unique=True),
    shared=st.booleans(),
)
def test_step_order_is_the_written_pages_then_the_rest_by_their_keys(
    t: int, rows: list[tuple[list[int], int]], layers: list[int], shared: bool
) -> None:
    seqs, tokens = _sequences(t, rows)
    if shared and len(seqs) > 1:  # a block two sequences share (a common prefix)
        seqs[1].set_block(0, seqs[0].block(0))
    written = [k for layer in layers for k in written_keys(seqs, tokens, layer)]
    rest = [k for layer in layers for s in seqs for k in s.pages(layer) if k not in written]
    assert step_order(seqs, tokens, layers, t) == written + rest


def _sequences(t: int, rows: list[tuple[list[int], int]]) -> tuple[list[SequenceState], list[int]]:
    seqs, tokens = [], []
    for i, (lengths, k) in enumerate(rows):
        seq = SequenceState(f"s{i}", LAYERS, t, None)
        for layer, n in enumerate(lengths):
            seq.set_kv_len(layer, n)
        while seq.num_blocks < -(-(max(lengths) + k) // t):
            seq.append_block(seq.private_block(seq.num_blocks), shared=False)
        seqs.append(seq)
        tokens.append(k)
    return seqs, tokens
