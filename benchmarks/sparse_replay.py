"""Replay benchmarks/sparse.py's top-k windows offline, to compare page-selection rules.

    python benchmarks/sparse_replay.py RULES_JSON [--windows N] [--first W]

    python benchmarks/sparse_replay.py '[{}, {"score": "oracle"}, {"page_tokens": 8,
        "recent": 4, "dense": 1}]'

The model runs over a transformers DynamicCache with an attention function that, at each
decode step and layer, masks out the pages a rule leaves out (prefill is dense), on the same
windows as benchmarks/sparse.py (1,500 tokens of context, 16 scored tokens each, teacher
forcing). A rule is a dict: ``page_tokens`` (16), ``k`` (25% of the prompt's pages),
``sink`` (1), ``recent`` (2), ``dense`` (first layers dense, 0), ``score`` (``"bound"``: Quest's
bound, each query head's page softmax summed over heads, as tierkv.attention.summaries;
``"oracle"``: the pages' real attention mass summed over heads; ``"mean"``: the page's mean key
in place of the bound; ``"mix"``: ``alpha`` (0.5) times the bound plus the rest times the mean
key's score, as ``sparse_mean_weight = 1 - alpha``), ``temp`` (1: the softmax's temperature
factor), ``select`` (``"sum"``; ``"max"``: the largest head's share; ``"per_kv_head"``: each KV
head its own pages, head-pages counted; ``"union"``: the KV heads' (head, page) scores ranked
together and pages taken until ``k`` distinct, all heads attending them, or with ``mask_own``
each head only the pages it picked),
``previous`` (true: add to each page's score the real attention it got at the previous decode
step of the same layer, summed over heads: no page is read for it that was not attended).
With the defaults it gives benchmarks/sparse.py's figures at 16-token pages. ``--first W``
replays windows ``W...`` of the same cut (past the 20 of benchmarks/sparse.py: held out; window
20 holds the head ranking's calibration text). It prints per
rule the greedy agreement with full attention, the perplexity ratio and the share of pages
attended per decode step and layer.
"""

from __future__ import annotations

import copy
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.nn.functional as F

from benchmarks._common import parser, table
from benchmarks.sparse import PROMPT, load, windows
from tierkv.attention.summaries import select_pages

EVALS = 16


@dataclass
class _Tally:
    nll: list[float] = field(default_factory=list)
    top: list[int] = field(default_factory=list)
    chosen: float = 0.0
    total: int = 0


_RULE: dict[str, Any] = {}
_COUNT = {"chosen": 0.0, "total": 0.0}
_PREVIOUS: dict[int, torch.Tensor] = {}  # layer -> real attention per page at the last step


def _page_mass(q: torch.Tensor, k: torch.Tensor, scale: float, t: int) -> torch.Tensor:
    """``[Hq, P]``: each query head's weight per page (bound softmax or real attention)."""
    hkv, s, d = k.shape
    hq = q.shape[0]
    g = hq // hkv
    p = -(-s // t)
    qg = q.float().view(hkv, g, d)
    if _RULE.get("score", "bound") == "oracle":
        w = torch.softmax(qg @ k.float().transpose(1, 2) * scale, -1).reshape(hq, s)
        return F.pad(w, (0, p * t - s)).view(hq, p, t).sum(-1)
    kk = torch.cat([k, k[:, -1:].expand(hkv, p * t - s, d)], 1).float().view(hkv, p, t, d)
    lo, hi = kk.amin(2), kk.amax(2)
    bound = qg.clamp(min=0) @ hi.transpose(1, 2) + qg.clamp(max=0) @ lo.transpose(1, 2)
    how = _RULE.get("score", "bound")
    if how in ("mean", "mix"):
        mean = qg @ kk.mean(2).transpose(1, 2)
        a = _RULE.get("alpha", 0.5) if how == "mix" else 0.0
        bound = a * bound + (1 - a) * mean
    return torch.softmax(bound.reshape(hq, p) * scale * _RULE.get("temp", 1.0), -1)


def _choose(layer: int, q: torch.Tensor, k: torch.Tensor, scale: float) -> list[list[int]]:
    """The pages each KV head attends (one list for all when pages load whole)."""
    r, hkv = _RULE, k.shape[0]
    t = r.get("page_tokens", 16)
    p = -(-k.shape[1] // t)
    if layer < r.get("dense", 0):
        _COUNT["chosen"] += p
        _COUNT["total"] += p
        return [list(range(p))] * hkv
    topk = r.get("k", math.ceil(0.25 * math.ceil(PROMPT / t)))
    sink, recent = r.get("sink", 1), r.get("recent", 2)
    mass = _page_mass(q, k, scale, t)
    how = r.get("select", "sum")
    if how == "per_kv_head":
        per = [select_pages(m.sum(0), topk, sink, recent) for m in mass.view(hkv, -1, p)]
        _COUNT["chosen"] += sum(len(x) for x in per) / hkv
        _COUNT["total"] += p
        return per
    if how == "union":
        per_head = mass.view(hkv, -1, p).sum(1)
        pages, own = _union(per_head, topk, sink, recent)
        _COUNT["chosen"] += len(pages)
        _COUNT["total"] += p
        return own if r.get("mask_own") else [pages] * hkv
    score = mass.amax(0) if how == "max" else mass.sum(0)
    prev = _PREVIOUS.get(layer)
    if r.get("previous") and prev is not None:
        score = score + F.pad(prev, (0, p - prev.shape[0]))
    pages = select_pages(score, topk, sink, recent)
    _COUNT["chosen"] += len(pages)
    _COUNT["total"] += p
    return [pages] * hkv


def _union(
    per_head: torch.Tensor, topk: int, sink: int, recent: int
) -> tuple[list[int], list[list[int]]]:
    """KV heads' (head, page) scores ranked together; pages taken until ``topk`` distinct."""
    hkv, p = per_head.shape
    lo, hi = min(sink, p), max(min(sink, p), p - recent)
    fixed = [*range(lo), *range(hi, p)]
    if hi - lo <= topk:
        return list(range(p)), [list(range(p))] * hkv
    order = per_head[:, lo:hi].flatten().argsort(descending=True).tolist()
    taken: set[int] = set()
    own: list[set[int]] = [set() for _ in range(hkv)]
    for i in order:
        h, page = divmod(i, hi - lo)
        taken.add(page + lo)
        own[h].add(page + lo)
        if len(taken) == topk:
            break
    return sorted([*fixed, *taken]), [sorted([*fixed, *o]) for o in own]


def replay_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; decode steps attend the rule's pages."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if query.shape[2] != 1 or not _RULE.get("on"):
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out, None
    scaling = kwargs.get("scaling")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    hkv, s = key.shape[1], key.shape[2]
    hq = query.shape[1]
    t = _RULE.get("page_tokens", 16)
    per = _choose(int(getattr(module, "layer_idx", 0)), query[0, :, 0], key[0], scale)
    allow = torch.zeros(hkv, s, dtype=torch.bool)
    for h, pages in enumerate(per):
        idx = (torch.tensor(pages).unsqueeze(1) * t + torch.arange(t)).flatten()
        allow[h, idx[idx < s]] = True
    g = hq // hkv
    bias = torch.where(allow, 0.0, float("-inf")).repeat_interleave(g, 0).view(1, hq, 1, s)
    if _RULE.get("previous"):  # the real attention on the attended pages, for the next step
        sc = query[0, :, 0].float().view(hkv, g, -1) @ key[0].float().transpose(1, 2) * scale
        w = torch.softmax(sc.reshape(hq, s) + bias[0, :, 0], -1).sum(0)
        layer = int(getattr(module, "layer_idx", 0))
        _PREVIOUS[layer] = F.pad(w, (0, -(-s // t) * t - s)).view(-1, t).sum(-1)
    out = F.scaled_dot_product_attention(
        query,
        key.repeat_interleave(g, 1),
        value.repeat_interleave(g, 1),
        bias.to(query.dtype),
        scale=scale,
    )
    return out.transpose(1, 2).contiguous(), None


def _decode(model: Any, cache: Any, first: Any, w: torch.Tensor) -> tuple[list[float], list[int]]:
    nll, top = [], []
    out = first
    for i in range(EVALS):
        logits = out.logits[0, -1].float()
        nll.append(float(torch.logsumexp(logits, 0) - logits[int(w[0, PROMPT + i])]))
        top.append(int(logits.argmax()))
        out = model(w[:, PROMPT + i : PROMPT + i + 1], past_key_values=cache)
    return nll, top


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("rules", help="a JSON list of rules (module docstring)")
    p.add_argument("--windows", type=int, default=20, help="windows replayed")
    p.add_argument("--first", type=int, default=0, help="the first window replayed")
    args = p.parse_args()
    rules: list[dict[str, Any]] = json.loads(args.rules)
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    torch.set_num_threads(1)
    AttentionInterface.register("replay", replay_attention)
    AttentionMaskInterface.register("replay", sdpa_mask)
    model, _, ids = load()
    model.set_attn_implementation("replay")
    wins = windows(ids, args.first + args.windows, EVALS)[args.first :]
    ref_nll: list[float] = []
    ref_top: list[int] = []
    got = [_Tally() for _ in rules]
    with torch.inference_mode():
        for n, w in enumerate(wins):
            _RULE.clear()
            base = DynamicCache(config=model.config)
            first = model(w[:, :PROMPT], past_key_values=base)
            a, b = _decode(model, copy.deepcopy(base), first, w)
            ref_nll += a
            ref_top += b
            for rule, g in zip(rules, got):
                _RULE.clear()
                _RULE.update(rule, on=True)
                _COUNT.update(chosen=0.0, total=0)
                _PREVIOUS.clear()
                a, b = _decode(model, copy.deepcopy(base), first, w)
                g.nll += a
                g.top += b
                g.chosen += _COUNT["chosen"]
                g.total += int(_COUNT["total"])
            print(f"  window {args.first + n} done", flush=True)
    full = math.exp(sum(ref_nll) / len(ref_nll))
    rows = []
    for rule, g in zip(rules, got):
        agree = sum(x == y for x, y in zip(g.top, ref_top)) / len(ref_top)
        ratio = math.exp(sum(g.nll) / len(g.nll)) / full
        rows.append([json.dumps(rule), agree, ratio, g.chosen / g.total])
    print(table(["rule", "agreement", "ppl / full", "pages"], rows))


if __name__ == "__main__":
    main()
