"""Every subcommand given arguments that cannot run: exit status 2, a one-line ``error:``
naming the flag, no traceback, nothing run first (the demo's model is never loaded: each
case returns at once). The planner's library call refuses the same inputs typed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierkv.cli import main
from tierkv.errors import InvalidInputError, TierKVError
from tierkv.plan.model import plan
from tierkv.plan.presets import GPUS, MODELS

TINY = ["demo", "--model", "tiny", "--quiet"]
BAD = [
    # the planner: zeros were the preset silently, negatives and NaN ran, 0 divided
    (["plan", "--layers", "0"], "layers"),
    (["plan", "--layers", "-3"], "layers"),
    (["plan", "--tp", "0"], "tp"),
    (["plan", "--concurrency", "0"], "concurrency"),
    (["plan", "--context", "-5"], "context"),
    (["plan", "--host-gb", "nan"], "host_gb"),
    (["plan", "--gpu-memory-gb", "0"], "memory_gb"),
    (["plan", "--resident-fraction", "2"], "resident_fraction"),
    (["plan", "--link-gbps", "0"], "link_gbps"),
    (["plan", "--params-b", "inf"], "params_b"),
    # the demo: tracebacks (ZeroDivisionError, IndexError, the registries' errors...)
    ([*TINY, "--batch", "0"], "--batch"),
    ([*TINY, "--turn", "0"], "--turn"),
    ([*TINY, "--prompt", "0"], "--prompt"),
    ([*TINY, "--generate", "0"], "--generate"),  # ran, "identical" with no token
    ([*TINY, "--compress-after", "-1"], "--compress-after"),
    ([*TINY, "--heads", "3", "--kv-heads", "2"], "--heads"),
    ([*TINY, "--device-fraction", "2"], "--device-fraction"),  # ran in full
    ([*TINY, "--device-fraction", "nan"], "--device-fraction"),
    ([*TINY, "--codec", "bogus"], "codec"),
    ([*TINY, "--backend", "bogus"], "backend"),
    ([*TINY, "--json", "/nonexistent/x.json"], "--json"),  # failed after the whole run
    ([*TINY, "--trace", "/nonexistent/t.json"], "--trace"),
    (["demo", "--generate", "-1"], "--generate"),  # smollm2: raised after loading the model
    (["demo", "--disk", "/tmp", "--disk-bytes", "0"], "--disk-bytes"),
    (["demo", "--disk-bytes", "1000000"], "--disk"),  # silently ignored without --disk
    ([*TINY, "--disk-bytes", "1000000"], "--disk"),
    # a 400-digit count: an OverflowError traceback from the planner's float products
    (["plan", "--context", "9" * 400], "context"),
    (["plan", "--concurrency", "9" * 400], "concurrency"),
    # the page server: a layout KVSpec refuses or a host tier with no page exited 1 with the
    # error's class name, after stale shared-memory segments had been swept
    (["serve", "--insecure", "--dtype", "bogus"], "dtype"),
    (["serve", "--insecure", "--dtype", "int8"], "dtype"),
    (["serve", "--insecure", "--page-tokens", "100000000"], "page_tokens"),
    (["serve", "--insecure", "--host-mb", "0.001"], "--host-mb"),
]


@pytest.mark.parametrize(("argv", "flag"), BAD, ids=[" ".join(a[-2:])[:40] for a, _ in BAD])
def test_bad_arguments_are_a_message_and_status_2(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and flag in err and "Traceback" not in err


def _trace(tmp_path: Path) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, 3]}\n')
    return str(path)


@pytest.mark.parametrize(
    ("extra", "flag"),
    [
        (["--limit", "-1"], "--limit"),  # dropped the last request
        (["--limit", "0"], "--limit"),
        (["--disk", "{tmp}", "--disk-tokens", "0"], "--disk-tokens"),  # one block, silently
        (["--disk", "{tmp}", "--disk-tokens", "-5"], "--disk-tokens"),
        (["--plot", "/nonexistent/p.png"], "--plot"),
    ],
)
def test_bad_replay_options_are_refused_before_the_replay(
    tmp_path: Path, extra: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = [a.format(tmp=tmp_path) for a in extra]
    argv = ["replay", _trace(tmp_path), "--capacity-tokens", "4096", "--quiet", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and flag in err
    assert not list(tmp_path.glob("segment-*"))


def test_a_typed_error_no_subcommand_caught_is_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierkv.cli import plan as plan_cli

    def boom(*_: object, **__: object) -> None:
        raise TierKVError("a typed failure")  # (not an input error: the planner lets it go)

    monkeypatch.setattr(plan_cli, "plan", boom)
    assert main(["plan"]) == 1
    assert capsys.readouterr().err == "error: a typed failure\n"


@pytest.mark.parametrize(
    "kw",
    [
        {"tp": 0},
        {"tp": 1.5},
        {"context": 0},
        {"concurrency": -1},
        {"resident_fraction": 0.0},
        {"resident_fraction": float("nan")},
        {"host_gb": -1.0},
        {"link_gbps": 0.0},
        {"reserve": 1.0},
        {"mfu": 2.0},
        {"host_gb": 10**400},  # (OverflowError: an int past a float's range)
        {"prompt_tokens": 10**400},
        {"context": 1 << 60},
    ],
)
def test_the_planner_refuses_inputs_no_setup_has(kw: dict[str, float]) -> None:
    with pytest.raises(InvalidInputError):
        plan(MODELS["llama-3-8b"], GPUS["h200"], **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["plan", "--host-gb", "-1"], "host_gb must be a number >= 0, got -1.0"),  # "> 0, got 0.0"
        (["plan", "--prompt", "-1"], "prompt_tokens must be a number >= 0, got -1"),  # "got 0"
    ],
)
def test_the_planner_names_the_value_given_and_its_bound(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err == f"error: {said}\n"
