"""The disk tier's admission filter on the real trace: hit rate and pages written, with and
without `tierkv.disk.admission.SeenTwice`.

    python benchmarks/disk_admission.py [--quick] [--requests FILE] [--json FILE]

The model is the chain's (tierkv/chain.py): a host tier of H blocks (LRU) above a disk tier of
D blocks (LRU). Requests in trace order (the Mooncake conversation trace, 512-token blocks);
a request's hits are the longest leading run of its blocks held by the host or the disk (disk
hits are imported into the host: the disk keeps its copy); its other blocks are inserted into
the host. Pages the host evicts are offered to the disk, which writes those it lacks (and its
filter admits), evicting its own LRU page when full. Filters: none (every offer written) and
SeenTwice remembering the last `memory` distinct offers, memory = 1x and 4x the disk's blocks.
Figures: hit rate (hits / all blocks), disk hit rate, pages written to disk; ratios: each
filter's hit rate and pages written against no filter at the same sizes.
"""

from __future__ import annotations

import hashlib
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import parser, table, write_json
from tierkv.disk.admission import SeenTwice
from tierkv.replay import Trace, load_trace, replay_infinite

TRACE = Path(__file__).resolve().parents[2] / "shared/data/mooncake/conversation_trace.jsonl"


def simulate(trace: Trace, host: int, disk: int, memory: int) -> dict[str, Any]:
    """Replay `trace` through host + disk LRU tiers; `memory` 0: no filter."""
    held: OrderedDict[int, None] = OrderedDict()
    on_disk: OrderedDict[int, None] = OrderedDict()
    filt = SeenTwice(memory) if memory else None
    keys: dict[int, bytes] = {}
    hits = disk_hits = blocks = written = offered = 0
    for ids in trace:
        blocks += len(ids)
        run = 0
        for b in ids:
            if b in held:
                held.move_to_end(b)
            elif b in on_disk:
                on_disk.move_to_end(b)
                disk_hits += 1
                held[b] = None
            else:
                break
            run += 1
        hits += run
        for b in ids[run:]:
            if b in held:
                held.move_to_end(b)
            else:
                held[b] = None
        victims = []
        while len(held) > host:
            victims.append(held.popitem(last=False)[0])
        want = [v for v in victims if v not in on_disk]
        offered += len(victims)
        if filt is not None and want:
            ks = [keys.get(v) or keys.setdefault(v, _key(v)) for v in want]
            want = [v for v, ok in zip(want, filt.admit(ks), strict=True) if ok]
        for v in want:
            on_disk[v] = None
            written += 1
            if len(on_disk) > disk:
                on_disk.popitem(last=False)
    return {
        "host_blocks": host,
        "disk_blocks": disk,
        "memory": memory,
        "hit_rate": hits / blocks,
        "disk_hit_rate": disk_hits / blocks,
        "pages_offered": offered,
        "pages_written": written,
    }


def _key(block: int) -> bytes:
    """A content key for trace block `block` (18 bytes, the private bit clear), as the store's."""
    k = bytearray(hashlib.blake2b(block.to_bytes(8, "little"), digest_size=18).digest())
    k[0] &= 0x7F
    return bytes(k)


def main() -> None:
    """Run the sweep."""
    p = parser(__doc__)
    p.add_argument("--requests", default=str(TRACE), help="the Mooncake trace (JSONL)")
    args = p.parse_args()
    trace = load_trace(args.requests, limit=3000 if args.quick else None)
    sizes = [(2000, d) for d in (4000, 8000, 16000, 32000)] + [
        (6000, d) for d in (6000, 12000, 24000, 48000)
    ]
    if args.quick:
        sizes = [(2000, 4000), (2000, 16000)]
    figures: dict[str, Any] = {"infinite_hit_rate": replay_infinite(trace).hit_rate, "runs": []}
    ratios: dict[str, float] = {}
    rows = []
    for host, disk in sizes:
        base = simulate(trace, host, disk, 0)
        figures["runs"].append(base)
        rows.append(
            [
                host,
                disk,
                "none",
                base["hit_rate"],
                base["disk_hit_rate"],
                base["pages_written"],
                1.0,
                1.0,
            ]
        )
        for mult in (1, 4):
            r = simulate(trace, host, disk, mult * disk)
            figures["runs"].append(r)
            hit = r["hit_rate"] / base["hit_rate"]
            wrote = r["pages_written"] / max(1, base["pages_written"])
            name = f"h{host}_d{disk}_seen_twice_x{mult}"
            ratios[f"{name}_hit_rate_vs_none"] = round(hit, 3)
            ratios[f"{name}_written_vs_none"] = round(wrote, 3)
            rows.append(
                [
                    host,
                    disk,
                    f"seen twice x{mult}",
                    r["hit_rate"],
                    r["disk_hit_rate"],
                    r["pages_written"],
                    hit,
                    wrote,
                ]
            )
    heads = [
        "host",
        "disk",
        "filter",
        "hit rate",
        "disk hits",
        "written",
        "hit vs none",
        "written vs none",
    ]
    print(f"{len(trace)} requests; infinite capacity hit rate {figures['infinite_hit_rate']:.3f}")
    print(table(heads, [[f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows]))
    write_json(args.json, figures, ratios)


if __name__ == "__main__":
    main()
