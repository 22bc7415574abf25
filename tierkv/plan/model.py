"""The planner's arithmetic: what fits, what moves per decode step, whether prefetch hides it.

Per GPU, with tensor parallelism ``tp`` (weights and KV heads split evenly)::

    kv budget     = gpu memory * (1 - reserve) - weights / tp
    kv per token  = 2 * layers * kv_heads * head_dim * dtype bytes / tp
    step time     = (weights / tp + KV read this step) / HBM bandwidth     (decode is memory bound)

    first token   = 2 * params * prompt / tp / (peak FLOP/s * mfu)  [+ prompt KV / link, tiered]

Without tiering every live token's KV sits on the GPU. With tiering the GPU holds the sequences of
the running batch plus the next batch being prefetched (``resident_fraction`` of all live KV);
the rest waits in host RAM, and each step moves the next batch's share over the link.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tierkv.errors import InvalidInputError
from tierkv.plan.presets import GpuPreset, ModelPreset

GB = 1e9


@dataclass(frozen=True)
class Plan:
    """Inputs and results of one planning question."""

    model: str
    gpu: str
    tp: int
    context: int
    concurrency: int
    kv_bytes_per_token: int
    kv_budget_gb: float
    max_context_plain: int
    max_context_tiered: int
    max_concurrency_plain: int
    max_concurrency_tiered: int
    device_kv_gb_plain: float
    device_kv_gb_tiered: float
    step_ms: float
    transfer_ms_per_step: float
    prefetch_hides_transfer: bool
    first_token_ms_plain: float
    first_token_ms_tiered: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly."""
        return asdict(self)


_MOST = 1 << 53
"""The largest count the planner takes (a float holds it exactly; the products of a 400-digit
--context overflowed float: an OverflowError from deep inside)."""


def _positive(name: str, x: float, *, most: float = math.inf, zero: bool = False) -> None:
    """Raise InvalidInputError unless ``x`` is a finite number in (0, most] ([0, most] with
    ``zero``: the message names the bound and the value given, not ``x + 1``)."""
    ok = 0 <= x <= most if zero else 0 < x <= most
    if isinstance(x, bool) or not isinstance(x, int | float) or not ok:
        bound = "" if most == math.inf else f" and at most {most}"
        raise InvalidInputError(
            f"{name} must be a number {'>=' if zero else '>'} 0{bound}, got {x!r}"
        )
    try:
        finite = math.isfinite(x)
    except OverflowError:  # an int past a float's range
        finite = False
    if not finite:
        raise InvalidInputError(f"{name} must be finite, got {x!r:.40}")


def _check(
    model: ModelPreset,
    gpu: GpuPreset,
    tp: int,
    host_gb: float,
    context: int,
    concurrency: int,
    reserve: float,
    resident_fraction: float,
) -> None:
    for name, n in (
        ("layers", model.layers),
        ("kv_heads", model.kv_heads),
        ("head_dim", model.head_dim),
        ("tp", tp),
        ("context", context),
        ("concurrency", concurrency),
    ):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= _MOST:
            raise InvalidInputError(f"{name} must be an int in [1, 2**53], got {n!r:.40}")
    for name, x in (
        ("params_b", model.params_b),
        ("gpu memory_gb", gpu.memory_gb),
        ("gpu hbm_gbps", gpu.hbm_gbps),
        ("gpu pcie_gbps", gpu.pcie_gbps),
        ("gpu tflops", gpu.tflops),
    ):
        _positive(name, x)
    _positive("host_gb", host_gb, zero=True)  # (0: no host RAM for KV)
    _positive("resident_fraction", resident_fraction, most=1.0)
    _positive("1 - reserve", 1 - reserve, most=1.0)


def plan(
    model: ModelPreset,
    gpu: GpuPreset,
    *,
    tp: int = 1,
    host_gb: float = 512.0,
    context: int = 8192,
    concurrency: int = 4,
    reserve: float = 0.1,
    resident_fraction: float = 0.5,
    prompt_tokens: int = 1024,
    link_gbps: float | None = None,
    mfu: float = 0.5,
) -> Plan:
    """Answer: how far do context and concurrency go with and without tiering on this setup?

    Raises InvalidInputError for inputs no setup has (a count under 1, a size or bandwidth
    that is not a positive finite number, fractions outside their range) and for weights
    that do not fit the GPU."""
    _check(model, gpu, tp, host_gb, context, concurrency, reserve, resident_fraction)
    _positive("prompt_tokens", prompt_tokens, zero=True)  # (0 tokens: no prefill)
    _positive("mfu", mfu, most=1.0)
    if link_gbps is not None:
        _positive("link_gbps", link_gbps)
    kv_tok = model.kv_bytes_per_token / tp  # per GPU
    weights = model.weights_gb * GB / tp
    budget = gpu.memory_gb * GB * (1 - reserve) - weights
    if budget <= 0:
        raise InvalidInputError(
            f"{model.name} weights ({weights / GB:.1f} GB per GPU at tp={tp}) do not fit "
            f"{gpu.name} ({gpu.memory_gb} GB with {reserve:.0%} reserve): raise --tp"
        )
    link = (link_gbps or gpu.pcie_gbps) * GB
    host = host_gb * GB / tp
    live = kv_tok * context * concurrency  # bytes of KV the workload keeps live, per GPU
    # plain: everything on the GPU
    max_ctx_plain = int(budget // (kv_tok * concurrency))
    max_conc_plain = int(budget // (kv_tok * context))
    # tiered: the GPU holds resident_fraction of the live KV; the host holds all of it
    max_ctx_tiered = int(min(budget / resident_fraction, host) // (kv_tok * concurrency))
    max_conc_tiered = int(min(budget / resident_fraction, host) // (kv_tok * context))
    dev_plain = min(live, budget)
    dev_tiered = min(live * resident_fraction, budget)
    # a decode step reads the weights and the running batch's KV from HBM
    step_s = (weights + live * resident_fraction) / (gpu.hbm_gbps * GB)
    # meanwhile the next batch's share crosses the link (in; the finished one goes out)
    moved = live * (1 - resident_fraction) / max(1, concurrency)
    transfer_s = moved / link
    # first token: prefill compute (2 * params * prompt FLOPs at ``mfu`` of the GPU's peak);
    # tiered, a full device tier must first write back room for the prompt's KV over the link
    prefill_s = 2 * model.params_b * 1e9 * prompt_tokens / tp / (gpu.tflops * 1e12 * mfu)
    make_room_s = kv_tok * prompt_tokens / link
    return Plan(
        model=model.name,
        gpu=gpu.name,
        tp=tp,
        context=context,
        concurrency=concurrency,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_budget_gb=budget / GB,
        max_context_plain=max_ctx_plain,
        max_context_tiered=max_ctx_tiered,
        max_concurrency_plain=max_conc_plain,
        max_concurrency_tiered=max_conc_tiered,
        device_kv_gb_plain=dev_plain / GB,
        device_kv_gb_tiered=dev_tiered / GB,
        step_ms=step_s * 1e3,
        transfer_ms_per_step=transfer_s * 1e3,
        prefetch_hides_transfer=transfer_s <= step_s,
        first_token_ms_plain=prefill_s * 1e3,
        first_token_ms_tiered=(prefill_s + make_room_s) * 1e3,
    )
