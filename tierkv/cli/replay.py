"""``tierkv replay``: prefix hit rates of eviction policies on a trace."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from tierkv.demo.disk_report import disk_figures, disk_rows
from tierkv.demo.report import print_rows
from tierkv.errors import TierKVError
from tierkv.policies import DEFAULT_POLICY, POLICIES
from tierkv.replay import ReplayResult, load_trace, replay, replay_belady, replay_infinite, sweep
from tierkv.replay_disk import DiskReplayResult, replay_with_disk


def add_parser(sub: Any) -> None:
    """Register the ``replay`` subcommand."""
    p = sub.add_parser(
        "replay",
        help="replay a Mooncake-format trace through the page table",
        description="Replay a trace (JSONL with hash_ids per request) through the real page "
        "table and print each policy's prefix hit rate beside the infinite-capacity maximum "
        "and the Belady (offline optimal) bound.",
    )
    p.add_argument("trace", help="trace file (Mooncake JSONL)")
    p.add_argument(
        "--capacity-tokens", type=int, required=True, help="cache capacity in tokens (e.g. 3000000)"
    )
    p.add_argument(
        "--policy",
        action="append",
        choices=sorted(POLICIES),
        help=f"policy to replay (repeatable; default: all, default policy is {DEFAULT_POLICY})",
    )
    p.add_argument("--block-tokens", type=int, default=512, help="tokens per trace block")
    p.add_argument("--limit", type=int, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="draw hit rate against capacity")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--disk",
        metavar="PATH",
        help="also replay the first policy with a disk tier in the directory PATH below the "
        "RAM tier (blocks RAM evicts written there, read back verified): hit rates with and "
        "without it, disk hits, bytes read and written, corrupt pages, I/O mode",
    )
    p.add_argument(
        "--disk-tokens", type=int, help="the disk tier's capacity in tokens (with --disk)"
    )
    p.add_argument(
        "--disk-page-bytes",
        type=int,
        default=4096,
        help="bytes written per block (with --disk; the KV of a block is larger: the byte "
        "figures scale with it, the hit rates do not)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Execute ``tierkv replay``."""
    if args.block_tokens <= 0:
        print(f"error: --block-tokens must be >= 1, got {args.block_tokens}", file=sys.stderr)
        return 2
    if args.capacity_tokens < args.block_tokens:
        print("error: --capacity-tokens must hold at least one block", file=sys.stderr)
        return 2
    why = _bad_args(args)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        trace = load_trace(args.trace, args.limit)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if (args.disk is None) != (args.disk_tokens is None):
        print("error: --disk and --disk-tokens go together", file=sys.stderr)
        return 2
    cap = args.capacity_tokens // args.block_tokens
    policies = args.policy or sorted(POLICIES)
    show = not args.quiet
    disk = None
    if args.disk is not None:
        try:
            disk = replay_with_disk(
                trace,
                cap,
                args.disk,
                max(1, args.disk_tokens // args.block_tokens),
                policy=args.policy[0] if args.policy else DEFAULT_POLICY,
                page_bytes=args.disk_page_bytes,
                progress=show,
            )
        except TierKVError as exc:
            print(f"error: --disk {args.disk}: {exc}", file=sys.stderr)
            return 2
    results = [replay(trace, cap, p, progress=show) for p in policies]
    bound = replay_belady(trace, cap, progress=show)
    inf = replay_infinite(trace)
    if args.json:
        doc = _as_json(results, bound, inf, cap)
        if disk is not None:
            doc["disk"] = _disk_json(disk, args.disk)
        print(json.dumps(doc, indent=2))
    else:
        _print_table(results, bound, inf, cap, len(trace))
        if disk is not None:
            alone = next((r for r in results if r.policy == disk.policy), None)
            _print_disk(disk, args.disk, inf, alone)
    if args.plot:
        _plot(trace, cap, policies, inf, args.plot, show)
    return 0


def _bad_args(args: argparse.Namespace) -> str:
    """Why the options cannot run ("" when they can): checked before the trace is read."""
    if args.limit is not None and args.limit < 1:
        return f"--limit must be at least 1, got {args.limit}"
    if args.disk_tokens is not None and args.disk_tokens < args.block_tokens:
        return f"--disk-tokens must hold at least one block ({args.block_tokens} tokens)"
    if args.plot:
        if importlib.util.find_spec("matplotlib") is None:
            return "--plot needs matplotlib (pip install 'tierkv-cache[plot]')"
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            return f"--plot {args.plot}: cannot write into {folder}"
    return ""


def _as_json(
    results: list[ReplayResult], bound: ReplayResult, inf: ReplayResult, cap: int
) -> dict[str, Any]:
    return {
        "capacity_blocks": cap,
        "infinite": inf.hit_rate,
        "belady": bound.hit_rate,
        "policies": {
            r.policy: {
                "hit_rate": r.hit_rate,
                "of_belady": r.hit_rate / bound.hit_rate if bound.hit_rate else 0.0,
                "hits": r.hits,
                "blocks": r.blocks,
                **({"policy_stats": r.policy_stats} if r.policy_stats else {}),
            }
            for r in results
        },
    }


def _disk_json(r: DiskReplayResult, path: str) -> dict[str, Any]:
    return {
        "policy": r.policy,
        "disk_blocks": r.disk_blocks,
        "hit_rate": r.hit_rate,
        "ram_hit_rate": r.ram_hit_rate,
        "ram_hits": r.ram_hits,
        "disk_hits": r.disk_hits,
        **disk_figures(r.disk),
        "path": path,
    }


def _print_disk(
    r: DiskReplayResult, path: str, inf: ReplayResult, alone: ReplayResult | None
) -> None:
    base = alone.hit_rate if alone is not None else r.ram_hit_rate  # the replay without disk
    gain = r.hit_rate / base if base else float("inf")
    of_inf = r.hit_rate / inf.hit_rate if inf.hit_rate else 0.0
    rows = [
        (
            f"{r.policy} with a disk tier of {r.disk_blocks} blocks",
            f"hit rate {r.hit_rate:.4f} (RAM {r.ram_hit_rate:.4f} + disk "
            f"{r.disk_hits / r.blocks if r.blocks else 0.0:.4f}): {gain:.2f}x RAM alone, "
            f"{of_inf:.3f} of infinite",
        ),
        *disk_rows(disk_figures(r.disk) | {"path": path}),
    ]
    print()
    print_rows("disk tier", rows)


def _print_table(
    results: list[ReplayResult], bound: ReplayResult, inf: ReplayResult, cap: int, n: int
) -> None:
    print(f"{n} requests, {inf.blocks} blocks, capacity {cap} blocks")
    print(f"{'policy':<12} {'hit rate':>9} {'of belady':>10} {'of infinite':>12}")
    rows = [(r.policy, r.hit_rate) for r in sorted(results, key=lambda r: -r.hit_rate)]
    rows += [("belady", bound.hit_rate), ("infinite", inf.hit_rate)]
    for name, rate in rows:
        ob = rate / bound.hit_rate if bound.hit_rate else 0.0
        oi = rate / inf.hit_rate if inf.hit_rate else 0.0
        mark = " (default)" if name == DEFAULT_POLICY else ""
        print(f"{name:<12} {rate:>9.4f} {ob:>10.3f} {oi:>12.3f}{mark}")
    for r in results:
        if r.policy_stats:
            print(f"{r.policy}: {_describe(r.policy_stats)}")


def _describe(stats: dict[str, float]) -> str:
    """One line of a policy's counters: admissions, then declines by rule, then the rest."""
    d = {k: v for k, v in stats.items() if k.startswith("declined_") and v}
    rest = {k: v for k, v in stats.items() if not k.startswith("declined_")}
    parts = [f"{k}={v:,.3g}" if isinstance(v, float) else f"{k}={v:,}" for k, v in rest.items()]
    if d:
        parts.append("declined: " + ", ".join(f"{k[9:]}={v:,}" for k, v in d.items()))
    return "; ".join(parts)


def _plot(
    trace: list[list[int]], cap: int, policies: list[str], inf: ReplayResult, path: str, show: bool
) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: --plot needs matplotlib (pip install 'tierkv-cache[plot]')", file=sys.stderr)
        return
    caps = sorted({max(1, int(cap * f)) for f in (0.25, 0.5, 1.0, 2.0, 4.0)})
    data = sweep(trace, caps, policies, progress=show)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in data.items():
        style = "--" if name == "belady" else "-"
        ax.plot(caps, [r.hit_rate for r in res], style, marker="o", label=name)
    ax.axhline(inf.hit_rate, color="grey", linestyle=":", label="infinite")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix block hit rate")
    ax.set_title("tierkv replay")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")
