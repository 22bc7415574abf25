"""The demos' closing tables: rows both ``tierkv demo`` models print (store figures, a lossy
pass) and the aligned printer. Imported by :mod:`tierkv.cli.demo` and
:mod:`tierkv.demo.hf_demo`; imports neither."""

from __future__ import annotations

from typing import Any


def store_figures(st: dict[str, Any], full_kv_bytes: int) -> dict[str, Any]:
    """The tiered pass's store figures both demos report, from ``KVStore.stats()``: the device
    peak against the full KV, hits per tier, loads, prefetch accuracy, late fetches, bytes
    moved."""
    loads = st["page_loads"]
    return {
        "peak_device_bytes": st["peak_device_bytes"],
        "peak_of_full_kv": st["peak_device_bytes"] / full_kv_bytes if full_kv_bytes else 0.0,
        "hits": st["hits"],
        "page_loads": loads,
        "prefetch_accuracy": st["prefetch_accuracy"],
        "late_fetches": st["late_fetches"],
        "late_of_loads": st["late_fetches"] / loads if loads else 0.0,
        "bytes_h2d": st["bytes_h2d"],
        "bytes_d2h": st["bytes_d2h"],
    }


def store_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The table rows every demo shares: device peak, hits, loads, prefetch, bytes moved."""
    mb = 1 / (1 << 20)
    return [
        (
            "peak device-tier bytes / full KV",
            f"{r['peak_device_bytes'] * mb:.2f} MiB / {r['full_kv_bytes'] * mb:.2f} MiB "
            f"({r['peak_of_full_kv']:.0%})",
        ),
        (
            "hits per tier (pages)",
            f"device {r['hits']['device']}, host {r['hits']['host']}, cold {r['hits']['cold']}",
        ),
        ("page loads", f"{r['page_loads']}"),
        ("prefetch accuracy", f"{r['prefetch_accuracy']:.3f}"),
        ("late fetches", f"{r['late_fetches']} ({r['late_of_loads']:.2%} of loads)"),
        ("bytes moved", f"H2D {r['bytes_h2d'] * mb:.1f} MiB, D2H {r['bytes_d2h'] * mb:.1f} MiB"),
    ]


def lossy_row(lc: dict[str, Any]) -> tuple[str, str]:
    """The table row of a lossy pass's figures."""
    return (
        f"{lc['codec']} on live KV (extra pass)",
        f"tokens identical: {'yes' if lc['tokens_identical'] else 'no'} "
        f"({lc['tokens_agreeing']}/{lc['tokens']} agree), max logit drift "
        f"{lc['max_logit_drift_before_divergence']:.4f} (smallest top-2 margin "
        f"{lc['smallest_top2_margin']:.5f})",
    )


def print_rows(title: str, rows: list[tuple[str, str]]) -> None:
    """A title line and aligned ``name  value`` rows."""
    width = max(len(k) for k, _ in rows)
    print(title)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
