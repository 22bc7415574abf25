"""The blocking facade, and the demo's parity check at a small size (asyncio and uvloop)."""

from __future__ import annotations

import pytest
import torch

import tierkv
from tierkv.demo.model import ModelConfig
from tierkv.demo.runner import DemoConfig, all_resident, device_budget, run

SPEC = tierkv.KVSpec(2, 2, 16, "fp32", 4)


def test_sync_facade_round_trip() -> None:
    with tierkv.SyncKVStore(
        SPEC, device_bytes=4 * SPEC.page_bytes, host_bytes=64 * SPEC.page_bytes
    ) as store:
        ref = {}
        for i, sid in enumerate(["a", "b", "c"]):
            assert store.add_sequence(sid, [i * 100 + t for t in range(8)]) == 0
            with store.lease([sid]) as lease:
                for layer in range(2):
                    k, v = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
                    lease.append(sid, layer, k, v)
                    ref[sid, layer] = (k, v)
        for (sid, layer), (k, v) in ref.items():
            with store.lease([sid], [layer]) as lease:
                got_k, got_v = lease.kv(sid, layer)
                assert torch.equal(got_k, k) and torch.equal(got_v, v)
        assert store.stats()["written_back"] > 0
        store.release("a")
        with pytest.raises(tierkv.SequenceError):
            store.release("a")
    with pytest.raises(tierkv.StoreClosedError):
        store.lookup([1])


SMALL = DemoConfig(
    sequences=4,
    batch=1,
    prompt=24,
    generate=20,
    turn=4,
    page_tokens=4,
    model=ModelConfig(vocab=128, dim=32, layers=4, heads=4, kv_heads=2),
)


@pytest.mark.parametrize("mode", ["swap", "stream"])
async def test_demo_parity_small(mode: str) -> None:
    from dataclasses import replace

    cfg = replace(SMALL, mode=mode)
    ref = await run(all_resident(cfg), cfg.total_kv_bytes() + 1024 * 1024)
    tiered = await run(cfg, device_budget(cfg))
    assert ref.tokens == tiered.tokens
    assert tiered.stats["page_loads"] > 0  # it really moved pages
    assert tiered.stats["peak_device_bytes"] <= device_budget(cfg)
    assert tiered.stats["background_errors"] == 0
    if mode == "stream":
        spec = cfg.model.kv_spec(cfg.kv_dtype, cfg.page_tokens)
        assert tiered.stats["peak_device_pages"] <= 3 * spec.blocks_for(cfg.prompt + cfg.generate)


def test_demo_cli_table_json_and_trace(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json

    from tierkv.cli import main

    out, trace = tmp_path / "demo.json", tmp_path / "trace.json"
    rc = main(
        [
            "demo",
            "--model",
            "tiny",
            "--repeat",
            "2",
            "--sequences",
            "4",
            "--batch",
            "1",
            "--prompt",
            "24",
            "--generate",
            "12",
            "--turn",
            "4",
            "--page-tokens",
            "4",
            "--layers",
            "2",
            "--dim",
            "32",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--quiet",
            "--json",
            str(out),
            "--trace",
            str(trace),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "tokens identical to all-resident  yes" in text
    report = json.loads(out.read_text())
    assert report["tokens_identical"] and report["peak_of_full_kv"] <= 0.45 + 1e-9
    assert report["rounds"] == 2 and "median of 2 rounds" in text
    assert len(report["speed_per_round"]) == 2 and report["cpu_speed_of_all_resident"] > 0
    assert "lossy_check" in report
    events = json.loads(trace.read_text())["traceEvents"]
    cats = {e["cat"] for e in events}
    assert "compute" in cats and any(c.startswith("stream") for c in cats)


def test_demo_defaults_to_smollm2_and_rejects_no_rounds(capsys) -> None:  # type: ignore[no-untyped-def]
    from tierkv.cli import build_parser, main

    args = build_parser().parse_args(["demo"])
    assert args.model == "smollm2" and args.repeat == 5 and not args.no_warmup
    assert main(["demo", "--model", "tiny", "--repeat", "0"]) == 2
    assert "--repeat" in capsys.readouterr().err


def test_timing_rounds_alternate_and_take_medians() -> None:
    from tierkv.demo import timing

    kinds = ["reference", "tiered", "int8"]
    assert [timing.order(kinds, r)[0] for r in range(4)] == [*kinds, "reference"]
    assert all(sorted(timing.order(kinds, r)) == sorted(kinds) for r in range(3))
    # 10 tokens; (wall, cpu) seconds per round; round 2's reference was hit by a burst
    f = timing.speed_figures(10, [(1.0, 1.0), (3.0, 1.0), (1.0, 1.0)], [(2.0, 2.0)] * 3)
    assert f["tokens_per_s"] == 5.0 and f["all_resident_tokens_per_s"] == 10.0
    assert f["speed_of_all_resident"] == 0.5  # the median drops the burst
    assert f["speed_per_round"] == [0.5, 1.5, 0.5]
    assert f["cpu_speed_of_all_resident"] == 0.5 and f["rounds"] == 3
    rows = dict(timing.speed_rows(f))
    assert "10.0: 0.500 (median of 3 rounds; 0.500-1.500)" in rows["tokens/s vs all-resident"]
