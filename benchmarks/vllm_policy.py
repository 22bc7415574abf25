"""tierkv's kvaware as the cache policy of vLLM 0.33's CPU offloading manager, against vLLM's own
``lru`` and ``arc``, on the Mooncake conversation trace.

    python benchmarks/vllm_policy.py [--trace FILE] [--capacity 6000] [--limit N] [--json FILE]

Each policy runs inside vLLM's `CPUOffloadingManager` (built with ``cache_policy`` and, for
kvaware, ``cache_policy_module_path``: the way vLLM's config loads it), one chunk per trace
block (512 tokens), driven as the scheduler does for each request in file order: its leading
resident chunks are looked up and loaded (``prepare_load`` / ``complete_load``: the hits), then
all of its chunks offered for store (``prepare_store``, which keeps the resident ones and
evicts for the rest; ``complete_store``), then ``on_request_finished``. Each chunk's position
(end token) is set as vLLM's scheduler sets it. Hit rate = hit chunks / all chunks (the
trace README's semantics; a request longer than the cache keeps its head). The same trace
through tierkv's own page table with kvaware (`tierkv.replay`) is reported beside it: how
much of kvaware survives vLLM's interface.

Ratios: kvaware-in-vLLM over vLLM's lru and arc (the same run, the same requests).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import table, write_json

TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
BLOCK_TOKENS = 512


def args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--capacity", type=int, default=6000, help="chunks in vLLM's CPU tier")
    p.add_argument("--limit", type=int, default=None, help="the first N requests only")
    p.add_argument("--json", metavar="FILE")
    return p.parse_args()


def run_vllm(
    trace: list[list[int]], capacity: int, policy: str, module: str | None
) -> tuple[int, Any]:
    """Chunk hits of ``trace`` through vLLM's CPU manager with ``policy``, and the policy."""
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    m = CPUOffloadingManager(
        num_chunks=capacity, cache_policy=policy, cache_policy_module_path=module
    )
    hits = 0
    for i, ids in enumerate(trace):
        ids = ids[:capacity]
        keys = [make_offload_key(h.to_bytes(8, "little") * 4, 0) for h in ids]
        ctx = ReqContext(req_id=str(i))
        for j, k in enumerate(keys):
            ctx.set_offload_key_position(k, (j + 1) * BLOCK_TOKENS)
        m.on_new_request(ctx)
        h = 0
        while h < len(keys) and m.lookup(keys[h], ctx).name == "HIT":
            h += 1
        hits += h
        if h:
            m.prepare_load(keys[:h], ctx)
            m.complete_load(keys[:h], ctx)
        out = m.prepare_store(keys, ctx)
        if out is None:
            raise RuntimeError(f"{policy}: request {i} could not be stored (nothing is pinned)")
        if out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx, True)
        m.on_request_finished(ctx)
    return hits, m._policy


def main() -> None:
    a = args()
    logging.basicConfig(level=logging.ERROR)
    from tierkv.replay import load_trace, replay

    trace = load_trace(a.trace, a.limit)
    blocks = sum(min(len(t), a.capacity) for t in trace)
    figures: dict[str, Any] = {"requests": len(trace), "chunks": blocks, "capacity": a.capacity}
    runs = [
        ("vllm lru", "lru", None),
        ("vllm arc", "arc", None),
        ("vllm + tierkv kvaware", "TierKVAwarePolicy", "tierkv.integrations.vllm.policy"),
    ]
    rows = []
    for label, policy, module in runs:
        t0 = time.perf_counter()
        hits, used = run_vllm(trace, a.capacity, policy, module)
        figures[label] = {"hits": hits, "hit_rate": hits / blocks, "s": time.perf_counter() - t0}
        if hasattr(used, "stats"):
            figures[label]["policy_stats"] = used.stats()
        rows.append([label, hits, hits / blocks, figures[label]["s"]])
    own = replay(trace, a.capacity, "kvaware")
    figures["tierkv page table kvaware"] = own.to_dict()
    rows.append(["tierkv page table kvaware", own.hits, own.hit_rate, ""])
    ours = figures["vllm + tierkv kvaware"]["hit_rate"]
    ratios = {
        "kvaware_vs_vllm_lru": ours / figures["vllm lru"]["hit_rate"],
        "kvaware_vs_vllm_arc": ours / figures["vllm arc"]["hit_rate"],
        "in_vllm_vs_tierkv_page_table": ours / own.hit_rate,
    }
    print(table(["policy", "hits", "hit rate", "s"], rows))
    print(table(["ratio", "value"], [[k, v] for k, v in ratios.items()]))
    write_json(a.json, figures, ratios)


if __name__ == "__main__":
    main()
