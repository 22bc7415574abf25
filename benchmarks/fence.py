"""Late one-sided writes against a page server (issue 23), for N rounds. One round: writer A
reserves 4 slots, its reservation ends (by ttl, by closing its control connection, or by a relay
that closes it), writer B publishes 4 other pages, A writes 0xAA into its old slots through its
own transport and commits, and B's pages are read back (tests/integration/fence_scenario.py).

    python benchmarks/fence.py [--quick] [--rounds N] [--json FILE]

Rounds are spread over {tcp, shm} x {ttl, close, relay} x A {names its agent in reserve, names
none, names it but never hears a revocation ("deaf": stalled between reserve and write)}, one
page server per combination. Printed per combination: B's pages read back wrong (target 0) or
missing, and how A's late writes ended: refused by the server's transport (tcp's write guard),
refused by A's own transport (its access revoked: shm), or landed in quarantined slots nobody
reads; A's commits told LeaseExpiredError; and, at the end, slots still quarantined or leased
(0: nothing leaked). Nothing here is timed.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from fence_scenario import (
    SECRET,
    SPEC,
    TIMEOUT,
    VARIANTS,
    WRITERS,
    Outcome,
    one_round,
    page_server,
    until,
)

from benchmarks._common import parser, table, write_json
from tierkv.remote import RemoteTier

KINDS = ("tcp", "shm")
FIELDS = ("wrong", "missing", "refused", "revoked", "quarantined", "told")


async def combination(kind: str, variant: str, writer: str, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds on one page server; the summed outcome and what was left held."""
    total = Outcome()
    ttl = 0.02 if variant == "ttl" else 60.0
    async with page_server(kind, lease_ttl=ttl) as srv:
        async with RemoteTier(
            srv.address, transport=kind, secret=SECRET, spec=SPEC, timeout=TIMEOUT
        ) as b:
            for r in range(rounds):
                out = await one_round(srv, b, kind, variant, r, writer=writer)
                for f in FIELDS:
                    setattr(total, f, getattr(total, f) + getattr(out, f))
        d = srv.directory
        assert d is not None
        await until(lambda: d.leases == 0 and d.quarantined == 0, "the fences resolved")
        srv.store.tiers.table.check()
        left = d.leases + d.quarantined
    return {f: getattr(total, f) for f in FIELDS} | {"rounds": rounds, "left_held": left}


async def run(rounds: int) -> dict[str, dict[str, Any]]:
    combos = list(itertools.product(KINDS, VARIANTS, WRITERS))
    each = -(-rounds // len(combos))  # at least `rounds` in all
    out: dict[str, dict[str, Any]] = {}
    for kind, variant, writer in combos:
        name = f"{kind}/{variant}/{writer}"
        out[name] = await combination(kind, variant, writer, each)
        print(name, out[name], flush=True)
    return out


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10_000, help="rounds in all (default 10,000)")
    args = p.parse_args()
    rounds = 120 if args.quick else args.rounds
    res = asyncio.run(run(rounds))
    rows = [[name, *(r[f] for f in ("rounds", *FIELDS, "left_held"))] for name, r in res.items()]
    print(table(["combination", "rounds", *FIELDS, "left held"], rows))
    total_rounds = sum(r["rounds"] for r in res.values())
    wrong = sum(r["wrong"] for r in res.values())
    late = sum(r["refused"] + r["revoked"] + r["quarantined"] for r in res.values())
    print(
        f"{total_rounds:,} rounds: {wrong} wrong pages served (target 0); "
        f"{late:,} late writes, every one refused or landed in quarantine; "
        f"{sum(r['left_held'] for r in res.values())} slots left held"
    )
    ratios = {"wrong pages / rounds (target 0)": wrong / max(1, total_rounds)}
    write_json(args.json, res, ratios)
    return 1 if wrong or late != total_rounds else 0


if __name__ == "__main__":
    sys.exit(main())
