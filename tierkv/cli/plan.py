"""``tierkv plan``: how far context and concurrency go with and without tiering."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TypeVar

from tierkv.plan.model import plan
from tierkv.plan.presets import GPUS, MODELS, GpuPreset, ModelPreset

T = TypeVar("T")


def add_parser(sub: Any) -> None:
    """Register the ``plan`` subcommand."""
    p = sub.add_parser(
        "plan",
        help="capacity planner: context and concurrency with and without KV tiering",
        description="Estimates the largest context and concurrency with and without tiering, "
        "the transfer time per decode step, and whether prefetch hides it. Models and GPUs come "
        "from presets, or give their numbers.",
    )
    p.add_argument(
        "--model",
        default="llama-2-70b",
        choices=sorted(MODELS),
        help="the model's preset (layers, KV heads, head dim, parameters)",
    )
    p.add_argument("--layers", type=int, help="override: layers")
    p.add_argument("--kv-heads", type=int, help="override: KV heads")
    p.add_argument("--head-dim", type=int, help="override: head dim")
    p.add_argument("--params-b", type=float, help="override: parameters, billions")
    p.add_argument(
        "--gpu",
        default="a100-80gb",
        choices=sorted(GPUS),
        help="the GPU's preset (memory, PCIe and NVLink bandwidth)",
    )
    p.add_argument("--gpu-memory-gb", type=float, help="override: GPU memory")
    p.add_argument("--link-gbps", type=float, help="host<->GPU GB/s (default: the GPU's PCIe)")
    p.add_argument("--nvlink", action="store_true", help="use the GPU's NVLink bandwidth")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel GPUs")
    p.add_argument("--host-gb", type=float, default=512.0, help="host RAM for KV")
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--concurrency", type=int, default=4, help="sequences served at once")
    p.add_argument("--prompt", type=int, default=1024, help="prompt tokens (first-token time)")
    p.add_argument(
        "--resident-fraction",
        type=float,
        default=0.5,
        help="share of live KV kept on the GPU when tiered (running + next batch)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=main)


def _given(override: T | None, preset: T) -> T:
    """An override given on the command line (0 too: refused by the planner, never the
    preset in its place), else the preset's."""
    return preset if override is None else override


def main(args: argparse.Namespace) -> int:
    """Run the planner and print its table."""
    m = MODELS[args.model]
    model = ModelPreset(
        m.name,
        layers=_given(args.layers, m.layers),
        kv_heads=_given(args.kv_heads, m.kv_heads),
        head_dim=_given(args.head_dim, m.head_dim),
        params_b=_given(args.params_b, m.params_b),
    )
    g = GPUS[args.gpu]
    memory = _given(args.gpu_memory_gb, g.memory_gb)
    gpu = GpuPreset(g.name, memory, g.hbm_gbps, g.pcie_gbps, g.nvlink_gbps, g.tflops)
    link = args.link_gbps
    if link is None and args.nvlink:
        link = gpu.nvlink_gbps
    try:
        r = plan(
            model,
            gpu,
            tp=args.tp,
            host_gb=args.host_gb,
            context=args.context,
            concurrency=args.concurrency,
            resident_fraction=args.resident_fraction,
            prompt_tokens=args.prompt,
            link_gbps=link,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0
    print(
        f"{model.name} on {args.tp} x {gpu.name}: KV {model.kv_bytes_per_token / 1024:.0f} KiB "
        f"per token, {r.kv_budget_gb:.1f} GB per GPU for KV"
    )
    rows = [
        (
            "max context at concurrency " + str(args.concurrency),
            f"{r.max_context_plain:,}",
            f"{r.max_context_tiered:,}",
        ),
        (
            f"max concurrency at context {args.context:,}",
            f"{r.max_concurrency_plain}",
            f"{r.max_concurrency_tiered}",
        ),
        (
            "device KV for this workload (GB/GPU)",
            f"{r.device_kv_gb_plain:.1f}",
            f"{r.device_kv_gb_tiered:.1f}",
        ),
        (
            "first-token time (ms)",
            f"{r.first_token_ms_plain:.0f}",
            f"{r.first_token_ms_tiered:.0f}",
        ),
    ]
    print(f"  {'':<40} {'plain':>10} {'tiered':>10}")
    for name, a, b in rows:
        print(f"  {name:<40} {a:>10} {b:>10}")
    hide = "yes" if r.prefetch_hides_transfer else "NO"
    print(
        f"  decode step {r.step_ms:.1f} ms, transfer per step {r.transfer_ms_per_step:.1f} ms: "
        f"prefetch hides it: {hide}"
    )
    return 0
