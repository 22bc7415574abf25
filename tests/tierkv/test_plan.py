import json

import pytest

from tierkv.cli import main
from tierkv.plan.model import plan
from tierkv.plan.presets import GPUS, MODELS


def test_llama2_70b_kv_arithmetic() -> None:
    m = MODELS["llama-2-70b"]
    assert m.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2  # 320 KiB
    r = plan(m, GPUS["a100-80gb"], tp=2, resident_fraction=0.25)
    assert r.max_context_tiered == pytest.approx(4 * r.max_context_plain, rel=0.01)
    assert r.max_concurrency_tiered >= 3 * r.max_concurrency_plain
    # the prompt's KV written back over PCIe: 160 KiB/token/GPU * 1024 tokens / 25 GB/s
    assert r.first_token_ms_tiered - r.first_token_ms_plain == pytest.approx(6.7, abs=0.1)


def test_weights_that_do_not_fit_are_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="raise --tp"):
        plan(MODELS["llama-2-70b"], GPUS["a100-80gb"], tp=1)
    assert main(["plan", "--tp", "1"]) == 2
    assert "raise --tp" in capsys.readouterr().err


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3-8b", "--gpu", "h200", "--tp", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "llama-3-8b" and out["max_context_tiered"] > out["max_context_plain"]
