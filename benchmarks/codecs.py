"""Cold-page codec throughput and error, against a single-thread memcpy of the same bytes.

    python benchmarks/codecs.py [--quick] [--json FILE] [--plot FILE.png] [--threads 1]
                                [--trace FILE.json]

Throughput counts uncompressed page bytes per second (read by encode, written by decode).
Each figure is printed with its ratio to ``numpy.copyto`` of the same number of bytes, timed
in the same run (best of ``--repeat``). Errors are measured on Gaussian pages whose channels
span two decades of scale (like K's outlier channels). Not a test: nothing asserts on time.
--trace writes every timed call (memcpy, encode, decode per case) as a span of a Chrome trace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

# the repository first: benchmarks/transports.py must not shadow the transports package
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import add_trace_flag, phase, span, start_trace, write_trace
from tierkv.codecs import Codec, create_codec
from tierkv.codecs.header import HEADER_BYTES
from tierkv.spec import KVSpec

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
CASES = [  # (codec, page dtype): the pairs that compress (plus none for overhead)
    ("none", "fp16"),
    ("fp16", "fp32"),
    ("bf16", "fp32"),
    ("bf16", "fp16"),
    ("int8", "fp16"),
    ("int8", "bf16"),
    ("int8", "fp32"),
    ("int8-group", "fp16"),
    ("int8-group", "bf16"),
    ("int8-group", "fp32"),
]
QUICK = {("none", "fp16"), ("fp16", "fp32"), ("int8", "fp16"), ("int8-group", "fp16")}


def best_of(fn: Callable[[], object], repeat: int, label: str = "") -> float:
    """Fastest of ``repeat`` timed calls after one warm-up, in seconds (each timed call is a
    span named ``label`` in the trace)."""
    fn()
    times = []
    for i in range(repeat):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        times.append(t1 - t0)
        span(label or "timed call", t0, t1, repeat=i)
    return min(times)


def memcpy_gbps(nbytes: int, repeat: int) -> float:
    """Single-thread copy bandwidth of ``nbytes`` (numpy.copyto of fresh, touched buffers)."""
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.ones_like(src)
    return nbytes / best_of(lambda: np.copyto(dst, src), repeat, f"memcpy {nbytes} B") / 1e9


def int8_half_scale(codec: Codec, data: torch.Tensor, x: torch.Tensor, spec: KVSpec) -> float:
    """Largest ``|q*s - x| / s`` over elements with s > 0, from the encoded bytes (<= 0.5)."""
    s_end = HEADER_BYTES + codec.scale_bytes(spec)
    s = data[:, HEADER_BYTES:s_end].view(torch.float32).double()
    q = data[:, s_end : s_end + spec.page_elems].view(torch.int8).double()
    n, two, h, t, d = x.shape
    if codec.name == "int8":
        s, xs = s.view(n, two, h, 1, d), x.double()
    else:
        g = codec.group_size
        s = s.view(n, two, h, t, d // g, 1)
        xs, q = x.double().view(*s.shape[:-1], g), q.view(*s.shape[:-1], g)
    ratio = (q.view(xs.shape) * s - xs).abs() / s
    return float(ratio[torch.isfinite(ratio)].max())


def run_case(name: str, dt: str, pages: int, repeat: int, copy: float) -> dict[str, float]:
    """Time and measure one (codec, page dtype) pair."""
    spec = KVSpec(num_layers=1, num_kv_heads=8, head_dim=128, dtype=DTYPES[dt], page_tokens=16)
    codec = create_codec(name)
    gen = torch.Generator().manual_seed(0)
    chan = torch.logspace(-1, 1, spec.head_dim)
    x = (torch.randn(pages, *spec.page_shape, generator=gen) * chan).to(spec.dtype)
    data = codec.encode(x, spec)
    out = torch.empty_like(x)
    t_enc = best_of(lambda: codec.encode(x, spec, out=data), repeat, f"encode {name}/{dt}")
    t_dec = best_of(lambda: codec.decode(data, spec, out=out), repeat, f"decode {name}/{dt}")
    nbytes = pages * spec.page_bytes
    err = (out.double() - x.double()).abs()
    fig = {
        "encode_GBps": nbytes / t_enc / 1e9,
        "decode_GBps": nbytes / t_dec / 1e9,
        "compression": codec.compression_ratio(spec),
        "max_abs_err": float(err.max()),
        "rel_rms_err": float(err.square().mean().sqrt() / x.double().square().mean().sqrt()),
        "max_err_over_bound": float((err / codec.error_bound(x, spec)).nan_to_num(0.0).max()),
    }
    if name.startswith("int8"):
        fig["max_err_over_scale"] = int8_half_scale(codec, data, x, spec)
    fig["encode_vs_memcpy"] = fig["encode_GBps"] / copy
    fig["decode_vs_memcpy"] = fig["decode_GBps"] / copy
    return fig


def plot(figures: dict[str, Any], path: str) -> None:
    """Bar chart of encode/decode throughput as a fraction of memcpy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in figures if isinstance(figures[k], dict)]
    pos = np.arange(len(keys))
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(pos - 0.2, [figures[k]["encode_vs_memcpy"] for k in keys], 0.4, label="encode")
    ax.bar(pos + 0.2, [figures[k]["decode_vs_memcpy"] for k in keys], 0.4, label="decode")
    ax.set_xticks(pos, keys, rotation=30, ha="right")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_ylabel("throughput / single-thread memcpy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; print a table; optionally write JSON and a PNG."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 cases, 64 pages, 3 repeats")
    ap.add_argument("--json", metavar="FILE", help="write {figures, ratios} here")
    ap.add_argument("--plot", metavar="PNG", help="draw the ratios (needs matplotlib)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--pages", type=int, help="pages per batch (default 512, quick 64)")
    ap.add_argument("--repeat", type=int, help="timed repeats (default 7, quick 3)")
    add_trace_flag(ap)
    args = ap.parse_args(argv)
    start_trace(args.trace)
    torch.set_num_threads(args.threads)
    pages = args.pages or (64 if args.quick else 512)
    repeat = args.repeat or (3 if args.quick else 7)
    cases = [c for c in CASES if not args.quick or c in QUICK]
    copies = {
        dt: memcpy_gbps(pages * KVSpec(1, 8, 128, DTYPES[dt], 16).page_bytes, repeat)
        for dt in sorted({dt for _, dt in cases})
    }
    figures: dict[str, Any] = {f"memcpy_GBps/{dt}": v for dt, v in copies.items()}
    ratios: dict[str, float] = {}
    print(
        f"{pages} pages of H=8 T=16 D=128, torch threads={args.threads}; memcpy GB/s: "
        + ", ".join(f"{dt} pages {v:.2f}" for dt, v in copies.items()),
        flush=True,
    )
    head = f"{'case':<18}{'enc GB/s':>9}{'x copy':>7}{'dec GB/s':>9}{'x copy':>7}"
    print(head + f"{'ratio':>7}{'max err':>11}{'rel rms':>9}{'err/bnd':>8}{'err/s':>7}")
    for i, (name, dt) in enumerate(cases, 1):
        with phase(f"case {name}/{dt}"):
            f = run_case(name, dt, pages, repeat, copies[dt])
        key = f"{name}/{dt}"
        figures[key] = f
        ratios[f"{key}/encode_vs_memcpy"] = f["encode_vs_memcpy"]
        ratios[f"{key}/decode_vs_memcpy"] = f["decode_vs_memcpy"]
        ratios[f"{key}/compression"] = f["compression"]
        es = f"{f['max_err_over_scale']:.3f}" if "max_err_over_scale" in f else "-"
        print(
            f"{key:<18}{f['encode_GBps']:>9.2f}{f['encode_vs_memcpy']:>7.2f}"
            f"{f['decode_GBps']:>9.2f}{f['decode_vs_memcpy']:>7.2f}{f['compression']:>7.2f}"
            f"{f['max_abs_err']:>11.3g}{f['rel_rms_err']:>9.2e}"
            f"{f['max_err_over_bound']:>8.3f}{es:>7}   [{i}/{len(cases)}]",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"figures": figures, "ratios": ratios}, fh, indent=2)
    write_trace(args.trace)
    if args.plot:
        plot(figures, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
