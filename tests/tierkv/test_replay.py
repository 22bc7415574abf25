import json
from collections import OrderedDict
from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.policies import DEFAULT_POLICY, POLICIES
from tierkv.replay import load_trace, replay, replay_belady, replay_infinite
from tierkv.traces import KINDS, synthetic_trace

TRACE = Path(__file__).resolve().parents[2].parent / "shared/data/mooncake/conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="shared trace not present")


def reference_lru(trace: list[list[int]], capacity: int) -> tuple[int, int]:
    """A straightforward LRU prefix cache, independent of the page table."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = blocks = 0
    for ids in trace:
        blocks += len(ids)
        for b in ids:
            if b not in cache:
                break
            hits += 1
        ids = ids[:capacity]
        for b in ids:
            if b in cache:
                cache.move_to_end(b)
        for b in ids:
            if b not in cache:
                cache[b] = None
                while len(cache) > capacity:
                    victim = next(k for k in cache if k not in ids)
                    del cache[victim]
    return hits, blocks


@needs_trace
def test_lru_replay_equals_reference_exactly() -> None:
    trace = load_trace(TRACE)
    for cap in (500, 6000):
        res = replay(trace, cap, "lru")
        assert (res.hits, res.blocks) == reference_lru(trace, cap)
    assert res.blocks == 288_500
    assert round(res.hit_rate, 3) == 0.139  # the trace README's reference figure


@needs_trace
def test_default_policy_meets_the_hit_rate_target() -> None:
    # issue 2: >= 0.20 of all blocks at 6,000 blocks (3M tokens), >= 0.55 of Belady's bound;
    # the replay is deterministic (integer keys), so this is the benchmark's figure exactly
    trace = load_trace(TRACE)
    ours = replay(trace, 6000, DEFAULT_POLICY)
    assert ours.hits >= 57_700 and ours.hit_rate >= 0.20
    assert ours.hits >= 0.55 * replay_belady(trace, 6000).hits


@pytest.mark.parametrize("kind", KINDS)
def test_default_policy_is_never_below_lru_on_synthetic_traces(kind: str) -> None:
    trace = synthetic_trace(kind, 4000, seed=1)
    for cap in (300, 1000):
        assert replay(trace, cap, DEFAULT_POLICY).hits >= replay(trace, cap, "lru").hits


def test_default_policy_resists_a_loop_longer_than_the_cache() -> None:
    # 400 documents of 16 blocks in a loop: LRU keeps only the shared root; the scan gate keeps
    # kvaware's history from readmitting the loop (2.6x and 9x LRU here)
    trace = synthetic_trace("loop", 4000, seed=1)
    for cap in (1000, 4000):
        assert replay(trace, cap, DEFAULT_POLICY).hits >= 2 * replay(trace, cap, "lru").hits


def test_bounds_frame_every_policy() -> None:
    # a small synthetic conversation trace: shared system prompt, growing conversations
    trace: list[list[int]] = []
    nxt = 1000
    convs: list[list[int]] = [[0] for _ in range(30)]
    for i in range(600):
        c = convs[(i * 7) % 30]
        c.extend(range(nxt, nxt + 3))
        nxt += 3
        trace.append(list(c))
        if len(c) > 20:
            convs[(i * 7) % 30] = [0]
    inf = replay_infinite(trace)
    for cap in (10, 40, 120):
        bound = replay_belady(trace, cap)
        assert bound.hit_rate <= inf.hit_rate
        for name in POLICIES:
            assert replay(trace, cap, name).hits <= bound.hits + 0, name


def test_load_trace_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n{"nope": 1}\n')
    with pytest.raises(ValueError, match=":2:"):
        load_trace(bad)
    assert load_trace(bad, limit=1) == [[1, 2]]
    bad.write_text('{"hash_ids": [1]}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ValueError, match=":2:"):  # (a RecursionError escaped: a traceback)
        load_trace(bad)
    bad.write_text('{"hash_ids": [1]}\n{"hash_ids": [true, 2]}\n')
    with pytest.raises(ValueError, match=":2: hash_ids"):  # (true was the block 1)
        load_trace(bad)
    for block in (-1, 2**127 - 1, 2**63, 10**400):  # (-1 and 2**127 - 1: one disk key)
        bad.write_text('{"hash_ids": [1]}\n' + json.dumps({"hash_ids": [block]}) + "\n")
        with pytest.raises(ValueError, match=":2: hash_ids"):
            load_trace(bad)
    bad.write_text(json.dumps({"hash_ids": [0, 2**63 - 1]}) + "\n")
    assert load_trace(bad) == [[0, 2**63 - 1]]


def test_cli_replay_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    lines = [json.dumps({"hash_ids": [0, i % 5, 100 + i]}) for i in range(50)]
    trace.write_text("\n".join(lines) + "\n")
    rc = main(
        [
            "replay",
            str(trace),
            "--capacity-tokens",
            "2048",
            "--block-tokens",
            "512",
            "--policy",
            "lru",
            "--policy",
            "kvaware",
            "--json",
            "--quiet",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["capacity_blocks"] == 4
    assert 0 <= out["policies"]["lru"]["hit_rate"] <= out["infinite"]
    assert "policy_stats" not in out["policies"]["lru"]  # LRU decides nothing to report
    stats = out["policies"]["kvaware"]["policy_stats"]  # kvaware's admission, by rule
    assert stats["scan_gate_closed"] == 0 and stats["history"] > 0
    assert sum(v for k, v in stats.items() if k.startswith("declined_")) > 0
    rc = main(["replay", str(trace), "--capacity-tokens", "2048", "--policy", "kvaware", "--quiet"])
    assert rc == 0
    assert "kvaware: admitted=" in capsys.readouterr().out
    png = tmp_path / "p.png"
    pytest.importorskip("matplotlib")
    rc = main(
        [
            "replay",
            str(trace),
            "--capacity-tokens",
            "2048",
            "--policy",
            "lru",
            "--quiet",
            "--plot",
            str(png),
        ]
    )
    assert rc == 0 and png.stat().st_size > 1000
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--capacity-tokens", "9999"]) == 2


def test_an_endless_line_is_refused_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tierkv replay /dev/zero``: one endless line was read into memory until the process
    died. Now a line past MAX_LINE is an InvalidInputError naming it, the CLI's one line."""
    import tierkv.replay as replay_module
    from tierkv.errors import InvalidInputError

    monkeypatch.setattr(replay_module, "MAX_LINE", 64)
    trace = tmp_path / "long.jsonl"
    trace.write_text('{"hash_ids": [1, 2]}\n' + '{"hash_ids": [' + "1, " * 40 + "1]}\n")
    with pytest.raises(InvalidInputError, match=r"long\.jsonl:2: a line over 64"):
        replay_module.load_trace(trace)
    assert main(["replay", str(trace), "--capacity-tokens", "9999", "--quiet"]) == 2
    assert "a line over 64" in capsys.readouterr().err
    ok = tmp_path / "ok.jsonl"
    ok.write_text('{"hash_ids": [1, 2]}\n' * 3)
    assert replay_module.load_trace(ok) == [[1, 2]] * 3
    assert main(["replay", str(ok), "--capacity-tokens", "9999", "--block-tokens", "0"]) == 2
    assert "--block-tokens must be >= 1" in capsys.readouterr().err
