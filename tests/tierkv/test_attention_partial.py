"""Partial attention and its log-sum-exp merge (tierkv.attention.partial), page summaries and
top-k selection (tierkv.attention.summaries): exact against float64 attention, the summary
bound never below a real score, selection rules and typed errors."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.attention.partial import attend, finish, merge, partial_attention
from tierkv.attention.summaries import KeySummaries, page_bounds, page_scores, select_pages
from tierkv.errors import InvalidInputError, SpecError


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if bias is not None:
        s = s + bias.double()
    return torch.softmax(s, dim=-1) @ v


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b).norm() / b.norm())


@settings(max_examples=40)
@given(
    seed=st.integers(0, 2**31 - 1),
    hkv=st.sampled_from([1, 2, 3]),
    g=st.sampled_from([1, 3]),
    n=st.sampled_from([1, 4]),
    s=st.integers(1, 300),
    cuts=st.lists(st.integers(0, 300), max_size=4),
    chunk=st.sampled_from([1, 7, 64, 1024]),
    spread=st.sampled_from([0.1, 1.0, 8.0]),
)
def test_parts_merge_to_full_attention(seed, hkv, g, n, s, cuts, chunk, spread) -> None:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hkv * g, n, 16, generator=gen) * spread
    k = torch.randn(2, hkv, s, 16, generator=gen) * spread
    v = torch.randn(2, hkv, s, 16, generator=gen)
    edges = sorted({0, s, *(c for c in cuts if c < s)})
    parts = [(k[:, :, a:b], v[:, :, a:b], None) for a, b in itertools.pairwise(edges)]
    parts.append((k[:, :, :0], v[:, :, :0], None))  # an empty part weighs nothing
    out = attend(q, parts, 16**-0.5, chunk=chunk)
    assert _rel(out, _reference(q, k, v, None)) < 1e-5


def test_masked_keys_and_a_fully_masked_part() -> None:
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 3, 8, generator=gen) for _ in range(3))
    k, v = torch.randn(1, 2, 40, 8, generator=gen), torch.randn(1, 2, 40, 8, generator=gen)
    bias = torch.zeros(1, 1, 3, 40)
    bias[..., 30:] = float("-inf")  # the second part is masked for every query
    bias[0, 0, 1, 5] = float("-inf")
    left = partial_attention(q, k[:, :, :30], v[:, :, :30], 8**-0.5, bias[..., :30])
    right = partial_attention(q, k[:, :, 30:], v[:, :, 30:], 8**-0.5, bias[..., 30:], chunk=4)
    assert bool(torch.isinf(right.m).all()) and float(right.l.abs().max()) == 0
    got = finish(merge([right, left]))
    assert _rel(got, _reference(q, k, v, bias)) < 1e-5


def test_bad_shapes_are_spec_errors() -> None:
    q, k = torch.zeros(1, 3, 1, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(SpecError):
        partial_attention(q, k, k, 1.0)  # 3 query heads over 2 KV heads
    with pytest.raises(SpecError):
        partial_attention(torch.zeros(1, 2, 1, 4), k, k, 1.0)
    with pytest.raises(SpecError):
        partial_attention(torch.zeros(1, 2, 1, 8), k, k, 1.0, torch.zeros(1, 1, 1, 4))
    with pytest.raises(SpecError):
        partial_attention(torch.zeros(1, 2, 1, 8), k, k, 1.0, chunk=0)
    with pytest.raises(SpecError):
        merge([])
    a = partial_attention(torch.zeros(1, 2, 1, 8), k, k, 1.0)
    b = partial_attention(torch.zeros(1, 2, 2, 8), k, k, 1.0)
    with pytest.raises(SpecError):
        merge([a, b])


@settings(max_examples=30)
@given(seed=st.integers(0, 2**31 - 1), tokens=st.lists(st.integers(1, 40), min_size=1, max_size=5))
def test_summary_bound_is_never_below_a_score(seed: int, tokens: list[int]) -> None:
    gen = torch.Generator().manual_seed(seed)
    table = KeySummaries(num_kv_heads=2, head_dim=4)
    keys = [torch.randn(2, n, 4, generator=gen) for n in tokens]
    total = sum(tokens)
    pages = [b"page%d" % p for p in range(-(-total // 8))]
    start = 0
    for k in keys:  # appends in pieces: partly filled pages are widened by the next
        table.append(pages, k, start, 8)
        start += k.shape[1]
    allk = torch.cat(keys, dim=1)
    assert len(table) == len(pages)
    summ = table.table(pages)
    for p in range(summ.shape[0]):
        page = allk[:, p * 8 : (p + 1) * 8]
        assert torch.equal(summ[p, 0], page.amin(dim=1)) and torch.equal(
            summ[p, 1], page.amax(dim=1)
        )
        assert torch.allclose(summ[p, 2], page.mean(dim=1), atol=1e-6)  # weighted over pieces
    q = torch.randn(6, 4, generator=gen)  # 3 query heads per KV head
    qg = q.view(2, 3, 4)
    lo, hi = summ[:, 0], summ[:, 1]
    bound = (qg.unsqueeze(2).clamp(min=0) * hi.transpose(0, 1).unsqueeze(1)).sum(-1) + (
        qg.unsqueeze(2).clamp(max=0) * lo.transpose(0, 1).unsqueeze(1)
    ).sum(-1)
    for p in range(summ.shape[0]):
        real = torch.einsum("hgd,htd->hgt", qg, allk[:, p * 8 : (p + 1) * 8]).amax(-1)
        assert bool((bound[:, :, p] >= real - 1e-5).all())
    scores = page_scores(q, summ, 0.5)
    assert scores.shape == (summ.shape[0],) and abs(float(scores.sum()) - 6.0) < 1e-4


def test_mean_weight_scores_halfway_to_the_mean_key() -> None:
    gen = torch.Generator().manual_seed(3)
    table = KeySummaries(num_kv_heads=2, head_dim=4)
    pages = [b"p%d" % i for i in range(5)]
    keys = torch.randn(2, 37, 4, generator=gen)
    table.append(pages, keys, 0, 8)
    summ = table.table(pages)
    q = torch.randn(4, 4, generator=gen)
    qg = q.view(2, 2, 4)
    lo, hi, mean = (summ[:, i].transpose(0, 1) for i in range(3))  # [Hkv, P, D]
    bound = qg.clamp(min=0) @ hi.transpose(1, 2) + qg.clamp(max=0) @ lo.transpose(1, 2)
    est = 0.7 * bound + 0.3 * (qg @ mean.transpose(1, 2))
    want = torch.softmax(est * 0.5, dim=-1).sum(dim=(0, 1))
    assert torch.allclose(page_scores(q, summ, 0.5, mean_weight=0.3), want, atol=1e-6)
    plain = page_scores(q, summ[:, :2], 0.5)  # weight 0: min and max alone, the bound
    assert torch.allclose(page_scores(q, summ, 0.5), plain)
    assert not torch.allclose(page_scores(q, summ, 0.5, mean_weight=0.3), plain)
    with pytest.raises(SpecError):
        page_scores(q, summ[:, :2], 0.5, mean_weight=0.3)  # no means to weigh


def test_selection_rules() -> None:
    scores = torch.tensor([0.0, 5, 1, 4, 2, 3, 0, 0])
    assert select_pages(scores, 2, sink=1, recent=2) == [0, 1, 3, 6, 7]
    assert select_pages(scores, 5, sink=1, recent=2) == list(range(8))  # covers all: exact
    assert select_pages(scores[:2], 1) == [0, 1]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidInputError):
            select_pages(scores, bad)  # type: ignore[arg-type]


def test_unknown_pages_rank_first_and_summaries_errors() -> None:
    table = KeySummaries(num_kv_heads=1, head_dim=2)
    pages = [b"a", b"b", b"c"]
    table.append(pages, torch.ones(1, 4, 2), 8, 4)  # pages a, b never seen (a reused prefix)
    scores = page_scores(torch.ones(1, 2), table.table(pages), 1.0)
    assert torch.isinf(scores[:2]).all() and bool(torch.isfinite(scores[2]))
    assert select_pages(torch.cat([scores, torch.zeros(4)]), 2, sink=0, recent=0) == [0, 1]
    table.append([b"d", b"e"], torch.ones(1, 4, 2), 2, 4)  # d first seen in mid-page: unknown
    assert bool(table.table([b"d"]).isnan().all()) and bool(table.table([b"e"]).isfinite().all())
    table.append([b"d", b"e"], torch.zeros(1, 1, 2), 4, 4)  # e's first token again: set anew
    assert torch.equal(table.table([b"e"])[0], torch.zeros(3, 1, 2))
    bad = page_bounds(torch.ones(2, 1, 2), 0, 4)  # two KV heads: not this table's
    with pytest.raises(SpecError):
        table.fold([b"a"], bad, 0)
    table.rename([b"c"], [b"content-c"])
    assert b"c" not in table and torch.equal(table.table([b"content-c"])[0, 1], torch.ones(1, 2))
    assert table.prune(lambda key: key == b"content-c") == 2 and len(table) == 1
    table.limit = 1
    assert not table.due()
    table.append([b"f"], torch.ones(1, 1, 2), 0, 4)
    assert table.due()


def test_summaries_refuse_bad_arguments_typed() -> None:
    """select_pages(sink=1.5) was a TypeError of a slice, scores given as a list an
    AttributeError; page_bounds of 2-D keys a ValueError, page_tokens 0 a ZeroDivisionError,
    no keys a RuntimeError. Now typed errors naming the argument."""
    scores = torch.rand(10)
    with pytest.raises(InvalidInputError, match="sink"):
        select_pages(scores, 2, sink=1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="recent"):
        select_pages(scores, 2, recent=-1)
    with pytest.raises(SpecError, match="scores"):
        select_pages([0.1, 0.2, 0.3], 1)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="scores"):
        select_pages(torch.rand(3, 4), 1)
    assert select_pages(scores, 2) == select_pages(scores, 2, sink=1, recent=2)
    k = torch.rand(2, 5, 8)
    with pytest.raises(SpecError, match="k"):
        page_bounds(torch.rand(5, 8), 0, 4)
    with pytest.raises(SpecError, match="k"):
        page_bounds(torch.rand(2, 0, 8), 3, 4)
    with pytest.raises(InvalidInputError, match="page_tokens"):
        page_bounds(k, 0, 0)
    with pytest.raises(InvalidInputError, match="start"):
        page_bounds(k, -1, 4)
    assert page_bounds(k, 3, 4).first == 0


def test_partial_attention_refuses_bad_arguments_typed() -> None:
    """merge([1]) and finish(None) were AttributeErrors, a str scale a TypeError, a NaN scale
    made every output NaN silently, attend's (k, v) pairs a ValueError of unpacking,
    empty_partial(dv=-1) a RuntimeError. Now typed errors."""
    from tierkv.attention.partial import empty_partial
    from tierkv.errors import InvalidTypeError

    q, k, v = torch.rand(1, 4, 1, 8), torch.rand(1, 2, 5, 8), torch.rand(1, 2, 5, 8)
    with pytest.raises(InvalidTypeError):
        merge([1])  # type: ignore[list-item]
    with pytest.raises(InvalidTypeError):
        finish(None)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        finish(partial_attention(q, k, v, 0.3), "float16")  # type: ignore[arg-type]
    for scale in (float("nan"), float("inf"), "x", True):
        with pytest.raises(InvalidInputError, match="scale"):
            partial_attention(q, k, v, scale)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        partial_attention(q.tolist(), k, v, 0.3)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError, match="triples"):
        attend(q, [(k, v)], 0.3)  # type: ignore[list-item]
    with pytest.raises(SpecError, match="dv"):
        empty_partial(q, -1)
    assert torch.isfinite(attend(q, [(k, v, None)], 0.3)).all()
