"""Tenants (issue 29): cache salts keep a probe tenant from any other tenant's prefixes, quotas
keep a flood from a quiet tenant's reserved pages, and neither slows the store.

    python benchmarks/tenants.py [--quick] [--json FILE] [--overhead-only]

(a) **Probe.** Tenant ``alice`` (salt ``alice``) caches prompts until they sit in every local
tier (device, host, cold pool, disk); tenant ``mallory`` (salt ``mallory``) sends alice's exact
prompts: its prefix hits, per tier where alice's pages are, must be 0 (alice's own lookups of
the same prompts hit, so the pages are there). Then, on the serving engine (the tiny model),
mallory's time to first token for alice's prompts against never-seen prompts of the same
length, 100 probes each, interleaved: the ratio of the medians must be 1 within noise (alice
re-sending her own prompt is shown beside it: the timing a shared cache would leak). The noise
is measured in the same run: a second set of never-seen prompts, interleaved with the two,
against the first (on a loaded 2-core box it moves by up to 10%).

(b) **Flood.** Tenant ``quiet`` (a host reservation covering its working set) re-reads its
prompts while tenant ``flood`` (a host limit) sends, before each round of them, distinct
prompts adding up to 10x its limit: quiet's pages evicted from its reserved tier must be 0,
and its hit rate with the flood / without >= 0.95. The same flood without quotas is shown
beside it.

(c) **Overhead.** The store's op stream (add a sequence reusing a shared prefix, lease, append
its KV, release) and a decode loop (step plans of 16 sequences, one token per layer per step)
with salts, tenants and quotas against the same runs without: two stores side by side, the
same work on each in chunks (8 requests, 10 steps), one chunk on each in turn with the first
alternating, so that both see the same load, chunk by chunk (the box is shared); CPU seconds
of this process; per round the ratio of the sums, the median of the rounds (and of all
chunks' ratios beside it); target <= 1.03. Beside it, the op stream's Python bytecodes with /
without (deterministic: the load does not move it).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from benchmarks._common import parser, phase, table, write_json
from tierkv import KVSpec, Quota
from tierkv.demo.model import ModelConfig
from tierkv.keys import page_key, prefix_keys
from tierkv.serving import Engine, EngineConfig, SamplingParams, TinyModel
from tierkv.store import KVStore

SPEC = KVSpec(num_layers=4, num_kv_heads=4, head_dim=32, dtype="fp16", page_tokens=16)
PAGE = SPEC.page_bytes
PROMPT = 64  # tokens: 4 blocks x 4 layers = 16 pages, 12 of them full-block pages
TIERS = ("device", "host", "cold", "disk")


def prompt(i: int, n: int = PROMPT) -> list[int]:
    return [(i * 7919 + j * 31) % 30_000 + 1 for j in range(n)]


def kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (SPEC.num_kv_heads, n, SPEC.head_dim)
    return (
        torch.randn(shape, generator=g).to(torch.float16),
        torch.randn(shape, generator=g).to(torch.float16),
    )


async def serve(s: KVStore, sid: str, toks: list[int], salt: str | None, tenant: str | None) -> int:
    """One request on the store: add, compute the KV it lacks, release; returns reused."""
    reused = await s.add_sequence(sid, toks, salt=salt, tenant=tenant)
    n = len(toks) - reused
    async with s.lease([sid]) as lease:
        for layer in range(SPEC.num_layers):
            await lease.append(sid, layer, *kv(n, layer))
    await s.release(sid)
    return reused


# -- (a) the probe ----------------------------------------------------------------------------
def where(s: KVStore, toks: list[int], salt: str) -> list[str]:
    """The tiers holding the first page of ``toks``' prefix under ``salt``."""
    first = page_key(prefix_keys(toks, SPEC.page_tokens, salt=salt)[0], 0)
    held = list(s.tiers.table.tiers_of(first))
    chain = s._chain  # (the disk tier: a store's chain below the host)
    if chain is not None and chain.lookup([first])[0]:
        held.append("disk")
    return held


async def probe_tiers(quick: bool) -> dict[str, Any]:
    """Alice's prompts spread over every local tier; mallory's hits on them per tier."""
    n = 48 if quick else 96
    with tempfile.TemporaryDirectory() as d:
        store = KVStore(
            SPEC,
            device_bytes=48 * PAGE,
            host_bytes=160 * PAGE,
            codec="fp16",
            cold_fraction=0.5,
            compress_after=1,
            disk_path=d,
            disk_bytes=4096 * 8192,
            tenants={"alice": Quota(), "mallory": Quota()},
        )
        async with store as s:
            for i in range(n):  # early prompts sink to disk, later ones stay higher up
                await serve(s, f"a{i}", prompt(i), "alice", "alice")
                if i % 4 == 3:
                    s.step()
            await s.drain()
            place = {i: where(s, prompt(i), "alice") for i in range(n)}
            per: dict[str, dict[str, int]] = {t: {"prompts": 0, "owner_hits": 0} for t in TIERS}
            for i, held in place.items():
                hit = s.lookup(prompt(i), salt="alice") > 0
                for tier in held:
                    per[tier]["prompts"] += 1
                    per[tier]["owner_hits"] += hit
            for i, held in place.items():  # then the probe: after alice's lookups, none moved
                got = await s.add_sequence(f"m{i}", prompt(i), salt="mallory", tenant="mallory")
                await s.release(f"m{i}")
                for tier in held:
                    per[tier]["probe_hit_tokens"] = per[tier].get("probe_hit_tokens", 0) + got
            stats = s.stats()["tenants"]
    for t in TIERS:
        per[t].setdefault("probe_hit_tokens", 0)
    return {"per_tier": per, "mallory_reused": stats["mallory"]["prefix_tokens_reused"]}


async def probe_ttft(quick: bool) -> dict[str, Any]:
    """Mallory's time to first token: alice's prompts vs never-seen ones, interleaved."""
    probes = 30 if quick else 100
    model = TinyModel(ModelConfig(vocab=32_000, dim=256, layers=6, heads=4, kv_heads=2, ffn=1024))
    cfg = EngineConfig(
        max_running=4,
        page_tokens=16,
        max_context=512,
        host_bytes=256 << 20,  # every prompt of alice stays cached (checked: her own hits)
        tenants={"alice": Quota(), "mallory": Quota()},
    )
    params = SamplingParams(max_tokens=1, temperature=0)
    n = 256

    async def ttft(engine: Engine, toks: list[int], salt: str, tenant: str) -> float:
        t0 = time.perf_counter()
        async for _ in engine.generate(toks, params, salt=salt, tenant=tenant):
            return time.perf_counter() - t0
        return float("nan")

    seen: list[float] = []
    fresh: list[float] = []
    fresh_b: list[float] = []  # a second never-seen set: the same figure's noise, this run
    own: list[float] = []
    async with Engine(model, cfg) as engine:
        for i in range(probes):  # alice's prompts, cached under her salt
            await engine.complete(prompt(10_000 + i, n), params, salt="alice", tenant="alice")
        await ttft(engine, prompt(99_999, n), "mallory", "mallory")  # warm-up
        for i in range(probes):
            arms = [
                (seen, prompt(10_000 + i, n)),
                (fresh, prompt(20_000 + i, n)),
                (fresh_b, prompt(30_000 + i, n)),
            ]
            for out, toks in arms[i % 3 :] + arms[: i % 3]:  # (each arm first in turn)
                out.append(await ttft(engine, toks, "mallory", "mallory"))
            own.append(await ttft(engine, prompt(10_000 + i, n), "alice", "alice"))
        tenants = engine.store.stats()["tenants"]
    return {
        "owner_reused_tokens": tenants["alice"]["prefix_tokens_reused"],
        "probes": probes,
        "prompt_tokens": n,
        "ttft_probe_ms": statistics.median(seen) * 1e3,
        "ttft_never_seen_ms": statistics.median(fresh) * 1e3,
        "ttft_never_seen_b_ms": statistics.median(fresh_b) * 1e3,
        "ttft_owner_hit_ms": statistics.median(own) * 1e3,
        "probe_reused_tokens": tenants["mallory"]["prefix_tokens_reused"],
    }


# -- (b) the flood ----------------------------------------------------------------------------
async def flood(quick: bool, with_flood: bool, quotas: bool) -> dict[str, Any]:
    """Quiet re-reads its working set (8 prompts of 16 pages) for some rounds; the flooder
    (if any) sends distinct prompts adding up to 10x its limit between them. Quiet's host
    reservation covers its prompts and a live request's pages: it never holds more, so any
    eviction of its host pages would take it below the reservation."""
    work, limit = 8, 64 * PAGE
    tenants = None
    if quotas:
        tenants = {
            "quiet": Quota(host_reserve=(work + 1) * 16 * PAGE),
            "flood": Quota(host_limit=limit),
        }
    store = KVStore(
        SPEC, device_bytes=48 * PAGE, host_bytes=224 * PAGE, codec=None, tenants=tenants
    )
    rounds = 3 if quick else 6
    flood_prompts = 10 * limit // (16 * PAGE)  # per round, 16 pages a prompt: 10x the limit
    hits = total = 0
    who = (lambda t: t) if quotas else (lambda t: None)
    async with store as s:
        for i in range(work):
            await serve(s, f"q{i}", prompt(i), "quiet", who("quiet"))
        k = 0
        for r in range(rounds):
            if with_flood:
                for _ in range(flood_prompts):
                    k += 1
                    await serve(s, f"f{k}", prompt(50_000 + k), "flood", who("flood"))
            for i in range(work):
                hits += await serve(s, f"q{r}-{i}", prompt(i), "quiet", who("quiet"))
                total += PROMPT - SPEC.page_tokens  # (the last block is always computed)
        st = s.stats()
    out: dict[str, Any] = {"hit_rate": hits / total, "flood_prompt_pages": k * 16 // rounds}
    if quotas:
        t = st["tenants"]
        out["quiet_host_evicted"] = t["quiet"]["tiers"]["host"]["evicted"]
        out["quiet_host_reserve_pages"] = t["quiet"]["tiers"]["host"]["reserve_pages"]
        out["quiet_host_pages"] = t["quiet"]["tiers"]["host"]["pages"]
        out["flood_host_evicted"] = t["flood"]["tiers"]["host"]["evicted"]
        out["flood_limit_pages"] = t["flood"]["tiers"]["host"]["limit_pages"]
    return out


# -- (c) overhead -----------------------------------------------------------------------------
def _tenanted(on: bool) -> dict[str, Any]:
    """Two tenants whose quotas every eviction checks (a reservation and a limit in the
    device and host tiers) but that do not bind here: the same victims as without them, so
    the ratio is the cost of the accounting, not of other decisions (those are (b)'s)."""
    if not on:
        return {}
    return {
        "tenants": {
            "a": Quota(host_reserve=4 * PAGE, device_reserve=4 * PAGE),
            "b": Quota(host_limit=1 << 30, device_limit=1 << 30),
        }
    }


def _op_store(on: bool) -> KVStore:
    return KVStore(SPEC, device_bytes=64 * PAGE, host_bytes=256 * PAGE, codec=None, **_tenanted(on))


def _request(i: int) -> tuple[list[int], str]:
    """Request ``i`` of the op stream (a shared system prefix, a popular conversation's own
    blocks, a new turn) and its tenant."""
    conv = (i * 2654435761) % 23
    toks = prompt(7, 32) + prompt(100 + conv, 32) + prompt(1000 + i, 16)
    return toks, "ab"[conv % 2]  # one salt for all: the same hits as without (salts apart: (a))


async def _paired(
    stores: dict[bool, Any],
    chunks: int,
    run: Any,
    cpu: dict[bool, float],
    chunk_ratios: list[float],
) -> None:
    """Run ``chunks`` chunks of work on both stores of ``stores`` (with and without tenants),
    one chunk at a time on each in turn, the first alternating, adding the CPU seconds of
    this process each took to ``cpu`` and each chunk's ratio to ``chunk_ratios``: the two
    see the same load, drifts and all, chunk by chunk."""
    for c in range(chunks):
        took = {}
        for on in (True, False) if c % 2 == 0 else (False, True):
            c0 = time.process_time()
            await run(stores[on], on, c)
            took[on] = time.process_time() - c0
            cpu[on] += took[on]
        chunk_ratios.append(took[True] / took[False])


async def op_stream(n: int, chunk: int = 8) -> tuple[float, list[float]]:
    """``n`` requests through add, lease, append, release on a store with salts, tenants and
    quotas and on one without, side by side in chunks of ``chunk`` (:func:`_paired`):
    returns the CPU ratio (with / without) and the chunks' ratios."""
    cpu = {True: 0.0, False: 0.0}
    chunks: list[float] = []

    async def run(s: KVStore, on: bool, c: int) -> None:
        for i in range(c * chunk, (c + 1) * chunk):
            toks, tenant = _request(i)
            await serve(s, f"r{i}", toks, "s" if on else None, tenant if on else None)

    async with _op_store(True) as with_, _op_store(False) as without:
        await _paired({True: with_, False: without}, n // chunk, run, cpu, chunks)
    return cpu[True] / cpu[False], chunks


async def decode(steps: int, batch: int = 16, chunk: int = 10) -> tuple[float, list[float]]:
    """``steps`` decode steps of ``batch`` sequences (step plans, one token per layer per
    sequence per step) on a store with salts, tenants and quotas and on one without, side
    by side in chunks of ``chunk`` steps: returns the CPU ratio and the chunks' ratios."""
    ids = [f"s{i}" for i in range(batch)]
    k, v = (x[:, :1].unsqueeze(0).expand(batch, -1, -1, -1).contiguous() for x in kv(1, 0))

    def store(on: bool) -> KVStore:
        return KVStore(
            SPEC, device_bytes=768 * PAGE, host_bytes=2048 * PAGE, codec=None, **_tenanted(on)
        )

    async def prefill(s: KVStore, on: bool) -> None:
        for i, sid in enumerate(ids):
            t, salt = ("ab"[i % 2], "s") if on else (None, None)
            await serve(s, sid + "-p", prompt(i), salt, t)
            await s.add_sequence(sid, prompt(i), salt=salt, tenant=t)
            async with s.lease([sid]) as lease:
                for layer in range(SPEC.num_layers):
                    await lease.append(sid, layer, *kv(SPEC.page_tokens, layer))

    async def run(s: KVStore, on: bool, c: int) -> None:
        for step in range(c * chunk, (c + 1) * chunk):
            async with s.step_plan(ids, tokens=1) as plan:
                for layer in range(SPEC.num_layers):
                    h = plan.layer_now(layer) or await plan.layer(layer)
                    h.append(k, v)
                    h.kv()
            for sid in ids:
                s.add_tokens(sid, [step % 1000 + 1])
            s.step()

    cpu = {True: 0.0, False: 0.0}
    chunks: list[float] = []
    async with store(True) as with_, store(False) as without:
        await prefill(with_, True)
        await prefill(without, False)
        await _paired({True: with_, False: without}, steps // chunk, run, cpu, chunks)
    return cpu[True] / cpu[False], chunks


async def bytecodes(n: int) -> float:
    """Python bytecodes executed by ``n`` requests of the op stream with salts, tenants and
    quotas / without (``sys.settrace`` opcode events: deterministic, whatever the load; C
    work counts as one call). The ratio."""
    count = [0]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "opcode":
            count[0] += 1
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        return local

    got = {}
    for on in (True, False):
        async with _op_store(on) as s:
            for i in range(n):  # warm (first allocations), then the same requests counted
                toks, tenant = _request(i)
                await serve(s, f"w{i}", toks, "s" if on else None, tenant if on else None)
            count[0] = 0
            sys.settrace(tracer)
            try:
                for i in range(n, 2 * n):
                    toks, tenant = _request(i)
                    await serve(s, f"r{i}", toks, "s" if on else None, tenant if on else None)
            finally:
                sys.settrace(None)
            got[on] = count[0]
    return got[True] / got[False]


async def overhead(quick: bool) -> dict[str, Any]:
    rounds = 3 if quick else 7
    n, steps = (160, 100) if quick else (400, 200)
    ops: list[float] = []
    dec: list[float] = []
    op_chunks: list[float] = []
    dec_chunks: list[float] = []
    await op_stream(16)  # warm-up (imports, first allocations)
    await decode(10)
    for _ in range(rounds):
        r, chunks = await op_stream(n)
        ops.append(r)
        op_chunks += chunks
        r, chunks = await decode(steps)
        dec.append(r)
        dec_chunks += chunks
    return {
        "rounds": rounds,
        "op_stream_bytecodes_ratio": await bytecodes(50 if quick else 100),
        "op_stream_requests": n,
        "decode_steps": steps,
        "op_stream_ratio": statistics.median(ops),
        "decode_ratio": statistics.median(dec),
        "op_stream_ratios": ops,
        "decode_ratios": dec,
        "op_stream_chunk_ratio_median": statistics.median(op_chunks),
        "decode_chunk_ratio_median": statistics.median(dec_chunks),
        "load_average": os.getloadavg(),
    }


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--overhead-only", action="store_true", help="only (c): the overhead ratios")
    args = p.parse_args()
    torch.set_num_threads(1)
    figures: dict[str, Any] = {}
    if args.overhead_only:
        with phase("overhead"):
            ov = figures["overhead"] = asyncio.run(overhead(args.quick))
        ratios = {
            "op_stream_with_vs_without": ov["op_stream_ratio"],
            "op_stream_bytecodes_with_vs_without": ov["op_stream_bytecodes_ratio"],
            "decode_with_vs_without": ov["decode_ratio"],
        }
        print(table(["figure", "value", "target"], [[k, v, "<= 1.03"] for k, v in ratios.items()]))
        print({k: v for k, v in ov.items() if k not in ratios})
        write_json(args.json, figures, ratios)
        return
    with phase("probe tiers"):
        figures["probe_tiers"] = asyncio.run(probe_tiers(args.quick))
    with phase("probe ttft"):
        figures["probe_ttft"] = asyncio.run(probe_ttft(args.quick))
    with phase("flood"):
        figures["flood"] = {
            "alone": asyncio.run(flood(args.quick, False, True)),
            "flood_with_quotas": asyncio.run(flood(args.quick, True, True)),
            "flood_without_quotas": asyncio.run(flood(args.quick, True, False)),
        }
    with phase("overhead"):
        figures["overhead"] = asyncio.run(overhead(args.quick))
    per = figures["probe_tiers"]["per_tier"]
    tt = figures["probe_ttft"]
    fl = figures["flood"]
    ov = figures["overhead"]
    ratios = {
        "probe_hit_tokens_per_tier": {t: per[t]["probe_hit_tokens"] for t in TIERS},
        "probe_ttft_vs_never_seen": tt["ttft_probe_ms"] / tt["ttft_never_seen_ms"],
        "never_seen_b_ttft_vs_never_seen": tt["ttft_never_seen_b_ms"] / tt["ttft_never_seen_ms"],
        "owner_hit_ttft_vs_never_seen": tt["ttft_owner_hit_ms"] / tt["ttft_never_seen_ms"],
        "quiet_evicted_below_reservation": fl["flood_with_quotas"]["quiet_host_evicted"],
        "flood_vs_limit": fl["flood_with_quotas"]["flood_prompt_pages"]
        / fl["flood_with_quotas"]["flood_limit_pages"],
        "quiet_hit_rate_flood_vs_alone": fl["flood_with_quotas"]["hit_rate"]
        / fl["alone"]["hit_rate"],
        "quiet_hit_rate_flood_vs_alone_without_quotas": fl["flood_without_quotas"]["hit_rate"]
        / fl["alone"]["hit_rate"],
        "op_stream_with_vs_without": ov["op_stream_ratio"],
        "op_stream_chunks_median": ov["op_stream_chunk_ratio_median"],
        "op_stream_bytecodes_with_vs_without": ov["op_stream_bytecodes_ratio"],
        "decode_with_vs_without": ov["decode_ratio"],
        "decode_chunks_median": ov["decode_chunk_ratio_median"],
    }
    print(
        table(
            ["tier", "alice's prompts there", "alice's hits", "mallory's hit tokens"],
            [
                [t, per[t]["prompts"], per[t]["owner_hits"], per[t]["probe_hit_tokens"]]
                for t in TIERS
            ],
        )
    )
    print()
    print(
        table(
            ["figure", "value", "target"],
            [
                ["probe TTFT / never-seen TTFT", ratios["probe_ttft_vs_never_seen"], "1 (noise)"],
                [
                    "... noise: never-seen B / never-seen",
                    ratios["never_seen_b_ttft_vs_never_seen"],
                    "",
                ],
                ["owner's hit TTFT / never-seen", ratios["owner_hit_ttft_vs_never_seen"], "(leak)"],
                [
                    "quiet pages evicted below reservation",
                    ratios["quiet_evicted_below_reservation"],
                    "0",
                ],
                ["flood per round / its limit", ratios["flood_vs_limit"], ">= 10"],
                [
                    "quiet hit rate flood / alone",
                    ratios["quiet_hit_rate_flood_vs_alone"],
                    ">= 0.95",
                ],
                [
                    "  ... without quotas",
                    ratios["quiet_hit_rate_flood_vs_alone_without_quotas"],
                    "",
                ],
                ["op stream CPU with / without", ratios["op_stream_with_vs_without"], "<= 1.03"],
                ["decode CPU with / without", ratios["decode_with_vs_without"], "<= 1.03"],
            ],
        )
    )
    write_json(args.json, figures, ratios)


if __name__ == "__main__":
    main()
