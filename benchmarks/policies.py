"""Eviction policies on real and synthetic traffic, against Belady's bound and against LRU.

1. The Mooncake conversation trace at 6,000 blocks (3M tokens) through every policy, beside the
   infinite-capacity hit rate and Belady's offline optimum; the figure is each policy's share
   of the Belady bound (issue 2: the default policy >= 0.20 and >= 0.55 of the bound).
2. Synthetic traces (looping scans, Zipf popularity, one-shot floods) at three capacities,
   the default policy against LRU: the ratio must not fall below 1.

Every replay runs through the real page table (``tierkv.replay``).

    python benchmarks/policies.py [--quick] [--json FILE] [--plot FILE.png] [--trace FILE.json]

--trace writes each replay (policy, trace, capacity) as a span of a Chrome trace.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# the repository first: benchmarks/transports.py must not shadow the transports package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import parser, phase, start_trace, table, write_json, write_trace
from tierkv.policies import DEFAULT_POLICY, POLICIES
from tierkv.replay import load_trace, replay, replay_belady, replay_infinite
from tierkv.traces import KINDS, synthetic_trace

TRACE = Path(__file__).resolve().parents[2] / "shared/data/mooncake/conversation_trace.jsonl"
BLOCKS = 6000
SYNTH_CAPACITIES = (500, 1000, 4000)
TARGET_HIT, TARGET_OF_BELADY = 0.20, 0.55


def conversation(limit: int | None) -> tuple[dict[str, float], list[list[object]]]:
    """Hit rates on the conversation trace at :data:`BLOCKS`; rows for the table."""
    with phase("load conversation trace"):
        trace = load_trace(TRACE, limit)
    rates: dict[str, float] = {}
    for name in POLICIES:
        print(f"  conversation trace: {name} ...", flush=True)
        with phase(f"conversation {name}", blocks=BLOCKS):
            rates[name] = replay(trace, BLOCKS, name).hit_rate
    print("  conversation trace: belady ...", flush=True)
    with phase("conversation belady", blocks=BLOCKS):
        rates["belady"] = replay_belady(trace, BLOCKS).hit_rate
    with phase("conversation infinite"):
        rates["infinite"] = replay_infinite(trace).hit_rate
    rows: list[list[object]] = []
    for name, r in sorted(rates.items(), key=lambda kv: kv[1]):
        label = f"{name} (default)" if name == DEFAULT_POLICY else name
        rows.append([label, r, r / rates["belady"], r / rates["lru"]])
    return rates, rows


def synthetic(n_requests: int) -> tuple[dict[str, dict[str, float]], list[list[object]]]:
    """Default policy against LRU on each synthetic trace at each capacity."""
    out: dict[str, dict[str, float]] = {}
    rows: list[list[object]] = []
    for kind in KINDS:
        trace = synthetic_trace(kind, n_requests, seed=1)
        for cap in SYNTH_CAPACITIES:
            print(f"  {kind} at {cap} blocks ...", flush=True)
            with phase(f"{kind} lru", blocks=cap):
                lru = replay(trace, cap, "lru").hit_rate
            with phase(f"{kind} {DEFAULT_POLICY}", blocks=cap):
                ours = replay(trace, cap, DEFAULT_POLICY).hit_rate
            out[f"{kind}@{cap}"] = {"lru": lru, DEFAULT_POLICY: ours}
            rows.append([kind, cap, lru, ours, ours / lru if lru else float("inf")])
    return out, rows


def plot(path: str, conv: dict[str, float], synth: dict[str, dict[str, float]]) -> None:
    """Two panels: the conversation trace by policy, the synthetic traces (ours / LRU)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = sorted(conv, key=conv.__getitem__)
    a.barh(
        names,
        [conv[n] for n in names],
        color=["C3" if n == DEFAULT_POLICY else "C0" for n in names],
    )
    a.axvline(TARGET_HIT, ls="--", c="k", lw=1, label=f"target {TARGET_HIT}")
    a.set_xlabel(f"block hit rate, conversation trace, {BLOCKS} blocks")
    a.legend()
    labels = list(synth)
    b.bar(labels, [synth[k][DEFAULT_POLICY] / max(synth[k]["lru"], 1e-9) for k in labels])
    b.axhline(1.0, ls="--", c="k", lw=1)
    b.set_ylabel(f"{DEFAULT_POLICY} hit rate / LRU hit rate")
    b.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--plot", metavar="FILE.png", help="draw the figures (PNG; needs matplotlib)")
    args = p.parse_args()
    start_trace(args.trace)
    limit = 4000 if args.quick else None
    n_synth = 5000 if args.quick else 20000
    print("replaying (through the real page table) ...", flush=True)
    conv, conv_rows = conversation(limit)
    synth, synth_rows = synthetic(n_synth)
    scope = f"first {limit} requests" if limit else "all requests"
    print(f"\nconversation trace, {BLOCKS} blocks, {scope}")
    print(table(["policy", "hit rate", "of belady", "vs lru"], conv_rows))
    print(f"\nsynthetic traces, {n_synth} requests: default policy {DEFAULT_POLICY!r} vs LRU")
    print(table(["trace", "blocks", "lru", DEFAULT_POLICY, "vs lru"], synth_rows))
    ours = conv[DEFAULT_POLICY]
    of_belady = ours / conv["belady"]
    worst = min(r[4] for r in synth_rows)
    print(
        f"\n{DEFAULT_POLICY}: {ours:.4f} (target {TARGET_HIT}), {of_belady:.3f} of Belady "
        f"(target {TARGET_OF_BELADY}); worst synthetic ratio vs LRU {worst:.3f} (target >= 1)"
    )
    ratios: dict[str, float] = {f"{n}_of_belady": conv[n] / conv["belady"] for n in POLICIES}
    ratios.update({f"{n}_vs_lru": conv[n] / conv["lru"] for n in POLICIES})
    ratios["default_of_target_hit"] = ours / TARGET_HIT
    ratios["default_of_belady"] = of_belady
    ratios["synthetic_worst_vs_lru"] = worst
    for k, v in synth.items():
        ratios[f"{k}_vs_lru"] = v[DEFAULT_POLICY] / v["lru"] if v["lru"] else float("inf")
    write_json(
        args.json,
        {"blocks": BLOCKS, "requests": limit, "conversation": conv, "synthetic": synth},
        ratios,
    )
    write_trace(args.trace)
    if args.plot:
        plot(args.plot, conv, synth)


if __name__ == "__main__":
    main()
