"""The timeline: a bounded ring, counter samples, spans around code, Chrome trace output."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tierkv.timeline import Timeline, merge


def test_disabled_records_nothing() -> None:
    tl = Timeline()
    tl.span("a", "compute", 0.0, 1.0)
    tl.counter("c", 0.0, x=1)
    with tl.measure("m", "bench"):
        pass
    assert len(tl) == 0
    assert tl.to_chrome()["traceEvents"] == []


@given(st.integers(1, 50), st.integers(0, 200))
def test_ring_keeps_the_newest_and_counts_the_dropped(cap: int, n: int) -> None:
    tl = Timeline(enabled=True, max_events=cap)
    for i in range(n):
        tl.span(f"s{i}", "compute", float(i), float(i) + 0.5)
    assert len(tl) == min(n, cap)
    assert tl.dropped == max(0, n - cap)
    doc = tl.to_chrome()
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in spans] == [f"s{i}" for i in range(max(0, n - cap), n)]
    assert doc["otherData"] == {"dropped_events": tl.dropped, "max_events": cap}


def test_tracks_are_named_threads_and_counters_belong_to_the_process() -> None:
    tl = Timeline(enabled=True)
    t = time.perf_counter()
    tl.span("load", "stream host->device", t, t + 0.002, pages=3)
    tl.span("forward", "compute", t + 0.001, t + 0.003)
    tl.counter("page server", t, pages=4, leases=1)
    events = tl.to_chrome(pid=7)["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    assert set(names) == {"stream host->device", "compute"}
    assert len(set(names.values())) == 2
    load = next(e for e in events if e["name"] == "load")
    assert load["tid"] == names["stream host->device"] and load["pid"] == 7
    assert load["dur"] == pytest.approx(2000.0) and load["args"] == {"pages": 3}
    ctr = next(e for e in events if e["ph"] == "C")
    assert ctr["args"] == {"pages": 4, "leases": 1} and "dur" not in ctr


def test_measure_records_a_failing_block() -> None:
    tl = Timeline(enabled=True)
    with pytest.raises(KeyError), tl.measure("phase", "bench", size=2):
        raise KeyError("x")
    (ev,) = [e for e in tl.to_chrome()["traceEvents"] if e["ph"] == "X"]
    assert ev["name"] == "phase" and ev["args"] == {"size": 2} and ev["dur"] >= 0


def test_timelines_share_an_origin_and_merge_apart(tmp_path: Path) -> None:
    a, b = Timeline(enabled=True), Timeline(enabled=True)
    t = time.perf_counter()
    a.span("x", "compute", t, t + 1)
    b.span("y", "compute", t, t + 1)
    doc = merge([("ref", a.to_chrome()), ("tiered", b.to_chrome())])
    x = next(e for e in doc["traceEvents"] if e["name"] == "x")
    y = next(e for e in doc["traceEvents"] if e["name"] == "y")
    assert x["ts"] == y["ts"] and (x["pid"], y["pid"]) == (1, 2)
    procs = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert procs == {1: "ref", 2: "tiered"}
    path = tmp_path / "t.json"
    a.write(str(path))
    assert json.loads(path.read_text()) == a.to_chrome()
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # no temporary file left


def test_bad_size_and_unwritable_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_events"):
        Timeline(max_events=0)
    with pytest.raises(OSError):
        Timeline(enabled=True).write(str(tmp_path / "missing" / "t.json"))


def test_overlapping_spans_get_lanes_nested_ones_stay() -> None:
    tl = Timeline(enabled=True)
    t = time.perf_counter()
    tl.span("outer", "compute", t, t + 10)
    tl.span("inner", "compute", t + 1, t + 2)  # nested: same lane
    tl.span("other task", "compute", t + 5, t + 15)  # overlaps outer: a second lane
    tl.span("later", "compute", t + 20, t + 21)  # after both: the first lane again
    events = tl.to_chrome()["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    tid = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert set(lanes) == {"compute", "compute #2"}
    assert tid["outer"] == tid["inner"] == tid["later"] == lanes["compute"]
    assert tid["other task"] == lanes["compute #2"]


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 20), st.sampled_from("ab"))))
def test_every_lane_nests_properly(spans: list[tuple[int, int, str]]) -> None:
    tl = Timeline(enabled=True)
    for i, (start, length, cat) in enumerate(spans):
        tl.span(f"s{i}", cat, float(start), float(start + length))
    events = tl.to_chrome()["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    by_lane: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            assert names[e["tid"]].split(" #")[0] == e["cat"]  # a lane of its own track
            by_lane.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"]))
    assert sum(map(len, by_lane.values())) == len(spans)
    for intervals in by_lane.values():
        open_ends: list[float] = []
        for start, end in sorted(intervals, key=lambda se: (se[0], -se[1])):
            while open_ends and open_ends[-1] <= start + 1e-3:  # us; float rounding of ts + dur
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1] + 1e-3  # nested in the enclosing span
            open_ends.append(end)
