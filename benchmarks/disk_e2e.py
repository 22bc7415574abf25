"""The disk tier end to end on a real model (issue 25's restart and decode targets), SmolLM2-135M
through transformers and ``TieredCache`` on a ``SyncKVStore`` with ``disk_path``.

    python benchmarks/disk_e2e.py [--quick] [--dir DIR] [--json FILE] [--rounds 3]
                                  [--only restart|decode]

Restart. A first process (a subprocess of this one) runs chat prompts sharing system-prompt
prefixes, each ``set_prompt`` + greedy ``generate`` on one store with a disk tier on PATH (host
tier about a third of the prompts' KV, so pages also leave for the disk while it runs),
records per prompt the prefix tokens its store holds at the end (``lookup``, capped at what a
request can reuse: whole pages, one token left to compute) and exits, closing the store. A
second process on the same PATH runs the same prompts: each one's tokens reused
(``set_prompt``, read from the first process's disk pages) and its greedy tokens, against
``generate`` with ``DynamicCache`` (recompute, no cache) in that process. Target: reused /
first's cached >= 0.99, tokens equal to recompute.

Decode. Conversations decoded turn by turn (multi-turn chat: each turn re-declares the whole
history with ``set_prompt``, generates, and releases it), round robin over the conversations:
tiered, the host tier holds at most 25% of the conversations' KV, the device tier a tenth, and
the rest waits on disk between turns (each turn reads its history's prefix pages back from
disk); all-resident, the same turns with a device tier that holds every conversation (no disk).
A third kind, ``host``, has the same device tier and a host tier holding everything (no disk):
the tiered runs against it are the disk's own cost. Targets: tokens identical; tokens/s of the
tiered runs against all-resident, the median of the rounds' ratios (each round runs every
kind, order rotating, after an untimed warm-up of each).
What this does not show: a live sequence's own pages never leave the host for the disk (the
store keeps the pages a live sequence owns in RAM: docs/store.md), so a decode step never
reads the disk; the disk serves each turn's history.

``--child first|second PATH OUT NEW`` is the restart's process entry (internal): the child
processes run this same script, which is why it stays one file of both targets (over 400 lines).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks._common import parser, table, write_json

PAGE_TOKENS = 16
MB = 1 << 20

SYSTEMS = [
    "You are a careful assistant for a public library. Answer questions about opening hours, "
    "borrowing rules, late fees, the reading rooms, the children's corner and the archive. "
    "Keep answers short, polite and factual; if you do not know, say so and suggest asking "
    "the front desk. The library opens at nine and closes at six on weekdays, at four on "
    "Saturdays, and stays closed on Sundays and public holidays. Books are lent for three "
    "weeks and may be renewed twice unless someone else has reserved them.",
    "You are a friendly cooking tutor. Explain techniques step by step, name the tools needed, "
    "warn about common mistakes, and suggest simple substitutions for ingredients that are "
    "hard to find. Prefer metric units. When a question is about food safety, give the safe "
    "temperature or time first and then the explanation. Never recommend raw flour or "
    "undercooked poultry, and mention allergens such as nuts, gluten and shellfish.",
]
QUESTIONS = [
    "Can I renew a book online?",
    "What happens if I return a book late?",
    "Is the archive open on Saturdays?",
    "How do I make a roux without lumps?",
    "What can I use instead of buttermilk?",
    "How long should I rest a steak?",
]
TOPICS = ["rivers", "volcanoes", "bees", "glaciers", "tides", "comets", "forests", "deserts"]


def _model() -> tuple[Any, Any]:
    import torch

    from tierkv.integrations.smollm2_loader import load_smollm2

    torch.set_num_threads(1)  # two shared cores: spinning intra-op workers slow a forward 5x
    return load_smollm2()


GREEDY = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)  # + logits


def _generate(model: Any, ids: Any, cache: Any, n: int) -> Any:
    """``n`` greedy tokens after ``ids`` (one row) with ``cache``; their logits too."""
    import torch

    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "cache": cache}
    with torch.inference_mode():
        return model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, **GREEDY)


# -- restart ---------------------------------------------------------------------------------


def restart_prompts(tok: Any, quick: bool) -> list[Any]:
    """The chat prompts of the restart target: each system prompt with several questions."""
    import torch

    pairs = [(0, 0), (0, 1)] if quick else [(s, q) for s in range(2) for q in range(3)]
    out = []
    for s, q in pairs:
        msgs = [
            {"role": "system", "content": SYSTEMS[s]},
            {"role": "user", "content": QUESTIONS[3 * s + q]},
        ]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
        out.append(torch.tensor([ids]))
    return out


def _restart_store(model: Any, path: str, prompts: list[Any]) -> Any:
    from tierkv import SyncKVStore
    from tierkv.integrations.hf import kv_spec_for

    spec = kv_spec_for(model.config, model.dtype, PAGE_TOKENS)
    kv = sum(spec.bytes_for(int(p.shape[1])) for p in prompts)
    return SyncKVStore(
        spec,
        codec=None,
        device_bytes=max(kv // 4, spec.bytes_for(2 * PAGE_TOKENS)),
        host_bytes=max(kv // 3, spec.bytes_for(512)),  # prompts' blocks leave for the disk
        disk_path=path,
        disk_bytes=4 * kv + (64 << 20),
    )


def _reusable(n: int) -> int:
    """The most prefix tokens a request of ``n`` tokens can reuse (whole pages, one left)."""
    return (n - 1) // PAGE_TOKENS * PAGE_TOKENS


def restart_child(mode: str, path: str, out: str, quick: bool, new_tokens: int) -> None:
    """One process of the restart target; writes its figures to ``out`` as JSON."""
    from transformers import DynamicCache

    from tierkv.integrations.hf import TieredCache

    model, tok = _model()
    prompts = restart_prompts(tok, quick)
    rows: list[dict[str, Any]] = []
    with _restart_store(model, path, prompts) as store:
        at_open = [store.lookup(p[0].tolist()) for p in prompts]  # the disk's index alone
        for p in prompts:
            row: dict[str, Any] = {"prompt_tokens": int(p.shape[1])}
            if mode == "second":
                ref = _generate(model, p, DynamicCache(config=model.config), new_tokens)
            with TieredCache(store=store) as cache:
                row["reused"] = cache.set_prompt(p)
                got = _generate(model, p, cache, new_tokens)
            row["tokens"] = got.sequences[0, p.shape[1] :].tolist()
            if mode == "second":
                row["recompute_tokens"] = ref.sequences[0, p.shape[1] :].tolist()
                row["max_logit_diff"] = max(
                    float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits, strict=True)
                )
            rows.append(row)
        for p, row in zip(prompts, rows, strict=True):
            held = store.lookup(p[0].tolist())
            row["cached_at_end"] = min(held, _reusable(int(p.shape[1])))
        stats = store.stats()
    doc = {"rows": rows, "at_open": at_open, "disk": _disk_figures(stats["disk"])}
    Path(out).write_text(json.dumps(doc), encoding="utf-8")


def _disk_figures(d: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "hits",
        "misses",
        "corrupt_pages",
        "imported",
        "import_missed",
        "stored",
        "write_failed",
        "recovered",
        "bytes_read",
        "bytes_written",
        "io_mode",
        "io_mode_reason",
    )
    return {k: d[k] for k in keys}


def _child(mode: str, path: Path, quick: bool, new_tokens: int) -> dict[str, Any]:
    out = path.parent / f"{mode}.json"
    cmd = [sys.executable, __file__, "--child", mode, str(path), str(out), str(new_tokens)]
    if quick:
        cmd.append("--quick")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"the {mode} process failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    doc: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    doc["seconds"] = time.perf_counter() - t0
    return doc


def restart(root: Path, quick: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The restart target: two processes on one disk path."""
    path = root / "restart"
    path.mkdir()
    n = 4 if quick else 8
    first = _child("first", path, quick, n)
    second = _child("second", path, quick, n)
    cached = sum(r["cached_at_end"] for r in first["rows"])
    reused = sum(r["reused"] for r in second["rows"])
    equal = sum(r["tokens"] == r["recompute_tokens"] for r in second["rows"])
    print(
        table(
            [
                "prompt",
                "tokens",
                "first: cached",
                "second: at open",
                "second: reused",
                "= recompute",
            ],
            [
                [
                    i,
                    r1["prompt_tokens"],
                    r1["cached_at_end"],
                    o,
                    r2["reused"],
                    str(r2["tokens"] == r2["recompute_tokens"]),
                ]
                for i, (r1, r2, o) in enumerate(
                    zip(first["rows"], second["rows"], second["at_open"], strict=True)
                )
            ],
        )
    )
    figures = {
        "prompts": len(first["rows"]),
        "new_tokens": n,
        "first_cached_prefix_tokens": cached,
        "second_reused_tokens": reused,
        "second_found_at_open": sum(second["at_open"]),
        "second_tokens_equal_recompute": equal,
        "max_logit_diff_vs_recompute": max(r["max_logit_diff"] for r in second["rows"]),
        "first_disk": first["disk"],
        "second_disk": second["disk"],
        "first_seconds": first["seconds"],
        "second_seconds": second["seconds"],
    }
    ratios = {
        "restart_reused_of_cached": reused / cached if cached else 0.0,
        "restart_tokens_equal_recompute": equal / len(second["rows"]),
    }
    return figures, ratios


# -- decode ----------------------------------------------------------------------------------


def _turn_ids(tok: Any, conv: int, turn: int) -> list[int]:
    """The tokens a user adds at ``turn`` of conversation ``conv`` (chat-formatted)."""
    topic = TOPICS[conv % len(TOPICS)]
    if turn == 0:
        msgs = [
            {"role": "system", "content": f"You are a science teacher. Today's topic: {topic}."},
            {"role": "user", "content": f"Tell me one surprising fact about {topic}."},
        ]
        ids: list[int] = tok.apply_chat_template(
            msgs, add_generation_prompt=True, return_dict=False
        )
        return ids
    text = f"<|im_end|>\n<|im_start|>user\nAnd another one about {topic}, please.<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    return list(tok.encode(text, add_special_tokens=False))


class Decode:
    """Multi-turn decode of ``convs`` conversations round robin on one store."""

    def __init__(self, model: Any, tok: Any, convs: int, turns: int, new_tokens: int) -> None:
        from tierkv.integrations.hf import kv_spec_for

        self.model, self.tok = model, tok
        self.convs, self.turns, self.new_tokens = convs, turns, new_tokens
        self.spec = kv_spec_for(model.config, model.dtype, PAGE_TOKENS)
        # the conversations' final lengths (tokens appended per turn do not depend on outputs)
        final = [
            sum(len(_turn_ids(tok, c, t)) + new_tokens for t in range(turns)) for c in range(convs)
        ]
        self.kv_bytes = sum(self.spec.bytes_for(n) for n in final)

    def store(self, kind: str, path: Path | None) -> Any:
        """The store of a pass: ``tiered`` (device a tenth of the KV, host <= 25%, disk the
        rest), ``host`` (the same device tier, the host holding everything: no disk) or
        ``resident`` (the device tier holds everything)."""
        from tierkv import SyncKVStore

        room = self.kv_bytes + self.spec.bytes_for(4 * PAGE_TOKENS)
        if kind == "resident":
            return SyncKVStore(self.spec, device_bytes=room, host_bytes=room, codec=None)
        if kind == "host":
            dev = self.kv_bytes // 10
            return SyncKVStore(self.spec, device_bytes=dev, host_bytes=room, codec=None)
        return SyncKVStore(
            self.spec,
            codec=None,  # the host budget all host tier (no lossy cold tier carved from it)
            device_bytes=self.kv_bytes // 10,
            host_bytes=self.kv_bytes // 4,
            disk_path=str(path),
            disk_bytes=2 * self.kv_bytes + (32 << 20),
        )

    def run(self, kind: str, path: Path | None) -> dict[str, Any]:
        """One pass: every turn of every conversation; tokens, wall seconds, store figures."""
        import torch

        from tierkv.demo import timing
        from tierkv.integrations.hf import TieredCache

        history: list[list[int]] = [[] for _ in range(self.convs)]
        out: list[list[int]] = [[] for _ in range(self.convs)]
        reused = 0
        with self.store(kind, path) as store, timing.no_gc():
            with timing.Clock() as clock:
                for t in range(self.turns):
                    for c in range(self.convs):
                        history[c] += _turn_ids(self.tok, c, t)
                        ids = torch.tensor([history[c]])
                        with TieredCache(store=store) as cache:
                            reused += cache.set_prompt(ids)
                            got = _generate(self.model, ids, cache, self.new_tokens)
                        new = got.sequences[0, ids.shape[1] :].tolist()
                        out[c].append(new)
                        history[c] += new
            st = store.stats()
        tokens = self.convs * self.turns * self.new_tokens
        res = {"tokens": out, "seconds": clock.wall, "tokens_per_s": tokens / clock.wall}
        res["tokens_per_cpu_s"] = tokens / clock.cpu  # other processes' load left out
        res["reused"] = reused
        res["host_capacity_bytes"] = st["tiers"]["host"]["capacity"] * self.spec.page_bytes
        res["device_capacity_bytes"] = st["tiers"]["device"]["capacity"] * self.spec.page_bytes
        if "disk" in st:
            res["disk"] = _disk_figures(st["disk"])
        return res


def decode(
    root: Path, quick: bool, rounds: int, model: Any, tok: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The decode target: tiered (device + host + disk) against all-resident."""
    from tierkv.demo import timing

    convs, turns, n = (6, 2, 4) if quick else (8, 3, 8)
    d = Decode(model, tok, convs, turns, n)
    paths = iter(range(1000))

    def one(kind: str) -> dict[str, Any]:
        path = None
        if kind == "tiered":
            path = root / f"decode-{next(paths)}"  # a fresh disk: nothing from an earlier pass
            path.mkdir()
        try:
            return d.run(kind, path)
        finally:
            if path is not None:
                shutil.rmtree(path)

    kinds = ["resident", "host", "tiered"]
    for kind in kinds:  # warm-up: first-call allocations, kernel choices
        one(kind)
    passes: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for r in range(rounds):
        for kind in timing.order(kinds, r):
            passes[kind].append(one(kind))
            p = passes[kind][-1]
            print(
                f"  round {r + 1}/{rounds} {kind}: {p['tokens_per_s']:.2f} tok/s, "
                f"{p['tokens_per_cpu_s']:.2f} tok/CPU-s"
            )
    ref = passes["resident"][0]["tokens"]
    identical = all(p["tokens"] == ref for ps in passes.values() for p in ps)

    def speed(of: str, against: str, key: str = "tokens_per_s") -> list[float]:
        return [a[key] / b[key] for a, b in zip(passes[of], passes[against], strict=True)]

    per_round, of_host = speed("tiered", "resident"), speed("tiered", "host")
    cpu = speed("tiered", "resident", "tokens_per_cpu_s")
    last = passes["tiered"][-1]
    figures = {
        "conversations": convs,
        "turns": turns,
        "new_tokens_per_turn": n,
        "tokens_per_pass": convs * turns * n,
        "kv_bytes": d.kv_bytes,
        "host_tier_bytes": last["host_capacity_bytes"],
        "device_tier_bytes": last["device_capacity_bytes"],
        "prefix_tokens_reused": last["reused"],
        "resident_prefix_tokens_reused": passes["resident"][-1]["reused"],
        "resident_tokens_per_s": [p["tokens_per_s"] for p in passes["resident"]],
        "host_tokens_per_s": [p["tokens_per_s"] for p in passes["host"]],
        "tiered_tokens_per_s": [p["tokens_per_s"] for p in passes["tiered"]],
        "speed_per_round": per_round,
        "speed_of_host_per_round": of_host,
        "cpu_speed_per_round": cpu,
        "tokens_per_cpu_s": {k: [p["tokens_per_cpu_s"] for p in ps] for k, ps in passes.items()},
        "disk": last["disk"],
    }
    ratios = {
        "decode_tokens_identical": 1.0 if identical else 0.0,
        "decode_host_of_kv": last["host_capacity_bytes"] / d.kv_bytes,
        "decode_tokens_per_s_of_resident": statistics.median(per_round),
        "decode_tokens_per_s_of_device_host": statistics.median(of_host),
        "decode_tokens_per_cpu_s_of_resident": statistics.median(cpu),
    }
    return figures, ratios


def main() -> int:
    """Run the targets; exit status 1 when a token differs or the restart ratio is short."""
    p = parser(__doc__)
    p.add_argument("--dir", help="where the disk tier's files go (default: a temp dir)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=["restart", "decode"])
    p.add_argument("--child", nargs=4, metavar=("MODE", "PATH", "OUT", "NEW"), help="internal")
    args = p.parse_args()
    if args.child:
        mode, path, out, new = args.child
        restart_child(mode, path, out, args.quick, int(new))
        return 0
    root = Path(tempfile.mkdtemp(prefix="tierkv-e2e-", dir=args.dir))
    figures: dict[str, Any] = {}
    ratios: dict[str, Any] = {}
    try:
        if args.only in (None, "restart"):
            f, r = restart(root, args.quick)
            figures["restart"], ratios = f, ratios | r
        if args.only in (None, "decode"):
            model, tok = _model()
            f, r = decode(root, args.quick, max(1, args.rounds), model, tok)
            figures["decode"], ratios = f, ratios | r
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(ratios, indent=2))
    write_json(args.json, figures, ratios)
    ok = ratios.get("restart_reused_of_cached", 1.0) >= 0.99
    ok = ok and ratios.get("restart_tokens_equal_recompute", 1.0) == 1.0
    ok = ok and ratios.get("decode_tokens_identical", 1.0) == 1.0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
