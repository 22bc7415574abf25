"""CRC-32C implementations side by side, measured in one run.

    python benchmarks/checksum.py [--quick] [--json FILE] [--plot FILE.png]

The contenders, each over the same buffer (1 MB, 256 KB and 16 KB, in cache, as the tcp transport
checksums a payload in runs of 128 KB as it lands):
  tierkv        tierkv.transports._crc32c, the extension built at install time (with the folded
                VPCLMULQDQ lane where the CPU has it)
  tierkv-lanes  the same, crc32 lanes only
  package       the `crc32c` package from PyPI (when installed)
  zlib          zlib.crc32 (CRC-32, the fallback algorithm; for scale)
Rounds (4 MB of checksums each, a few ms) alternate the contenders so that load from other
processes hits all alike; the table shows medians over the rounds and each one's ratio to the
package (the limit this file chases: the project keeps its own implementation only while it is
at least as fast). The load average before and after is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import table, write_json
from tierkv.transports import crc32c_native

SIZES = (1 << 20, 256 << 10, 16 << 10)
KB = 1 << 10


def contenders() -> dict[str, Callable[[Any, int], int]]:
    """Name -> fn(data, crc) for every implementation installed here."""
    out: dict[str, Callable[[Any, int], int]] = {}
    try:
        ext: Any = importlib.import_module("tierkv.transports._crc32c")
    except ImportError:
        ext = None
    if ext is not None and ext.init(True):
        out["tierkv"] = ext.crc32c  # main() switches the folded lane on and off between them
        out["tierkv-lanes"] = ext.crc32c
    with contextlib.suppress(ImportError):
        out["package"] = importlib.import_module("crc32c").crc32c
    out["zlib"] = zlib.crc32
    return out


def rate(fn: Callable[[Any, int], int], view: memoryview, total: int) -> float:
    """Bytes/s of `fn` over `view`, repeated until `total` bytes."""
    reps = max(1, total // len(view))
    t = time.perf_counter()
    for _ in range(reps):
        fn(view, 0)
    return reps * len(view) / (time.perf_counter() - t)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer rounds")
    p.add_argument("--rounds", type=int, help="rounds per size (default 61, --quick 15)")
    p.add_argument("--json", help="write {figures, ratios, machine} to this file")
    p.add_argument("--plot", type=Path, help="draw a bar chart (PNG; needs matplotlib)")
    args = p.parse_args(argv)
    rounds = args.rounds or (15 if args.quick else 61)
    fns = contenders()
    ext: Any = importlib.import_module("tierkv.transports._crc32c") if "tierkv" in fns else None
    load_before = os.getloadavg()
    figures: dict[str, Any] = {"in_use": crc32c_native.implementation(), "rounds": rounds}
    ratios: dict[str, float] = {}
    rows: list[list[Any]] = []
    data = bytearray(os.urandom(max(SIZES)))
    for size in SIZES:
        view = memoryview(data)[:size]
        results = {fn(view, 0) for name, fn in fns.items() if name != "zlib"}
        if len(results) > 1:
            raise SystemExit(f"implementations disagree at {size} bytes: {results}")
        got: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                if ext is not None and name.startswith("tierkv"):
                    ext.init(name == "tierkv")  # the folded lane, or the crc32 lanes only
                got[name].append(rate(fn, view, 4 << 20))
        if ext is not None:
            ext.init(True)
        med = {name: statistics.median(v) for name, v in got.items()}
        figures[f"{size // KB}kb_gbps"] = {name: v / 1e9 for name, v in med.items()}
        base = med.get("package")
        for name, v in med.items():
            ratio = v / base if base else float("nan")
            if base and name != "package":
                ratios[f"{name}_vs_package_{size // KB}kb"] = ratio
            rows.append([f"{size // KB} KB", name, v / 1e9, "" if base is None else ratio])
        print(f"  {size // KB:>5} KB done", flush=True)
    figures["load_before"], figures["load_after"] = load_before, os.getloadavg()
    print()
    print(table(["buffer", "implementation", "GB/s", "vs package"], rows))
    print(
        f"(medians of {rounds} interleaved rounds; in use here: "
        f"{figures['in_use'] or 'none (crc32 only)'}; load {load_before[0]:.2f} before, "
        f"{figures['load_after'][0]:.2f} after)"
    )
    write_json(args.json, figures, ratios)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3))
        width = 0.8 / len(fns)
        for k, name in enumerate(fns):
            ys = [figures[f"{s // KB}kb_gbps"][name] for s in SIZES]
            ax.bar([i + k * width for i in range(len(SIZES))], ys, width, label=name)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(SIZES))])
        ax.set_xticklabels([f"{s // KB} KB" for s in SIZES])
        ax.set_ylabel("GB/s")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
