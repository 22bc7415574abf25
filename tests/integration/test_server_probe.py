"""The example server against a careless or hostile client (the probe of issue 29's and 26's
surfaces): numbers past float's range, prompts the engine refuses for other reasons than
length, fields it cannot honour, unicode salts and tenant names. Every answer is OpenAI's error
shape with the right status and code, never a 500, and the server keeps serving."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("aiohttp")
sys.path.insert(0, str(Path(__file__).parent))
from test_server import one_thread, served, server  # noqa: F401

from tierkv.errors import InvalidInputError


async def raw(session: Any, url: str, body: bytes) -> tuple[int, Any]:
    head = {"Content-Type": "application/json"}
    async with session.post(f"{url}/v1/completions", data=body, headers=head) as r:
        return r.status, await r.json()


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [  # a 400-digit integer literal is valid JSON; float() of it was an OverflowError: a 500
        (b'{"prompt": "hi", "temperature": ' + b"9" * 400 + b"}", "temperature", None),
        (b'{"prompt": "hi", "top_p": ' + b"9" * 400 + b"}", "top_p", None),
        # ids outside the vocabulary are no context-length error (the code said so)
        (b'{"prompt": [100000]}', "prompt", "invalid_prompt"),
        (b'{"prompt": [1, 2], "max_tokens": 64, "echo": true}', "echo", "unsupported"),
        (b'{"prompt": [1, 2], "logprobs": 5}', "logprobs", "unsupported"),
        (b'{"prompt": [1, 2], "best_of": 3}', "best_of", "unsupported"),
        (b'{"prompt": [1, 2], "suffix": "tail"}', "suffix", "unsupported"),
        # sampling fields that were ignored silently (top_k 5 sampled the whole vocabulary)
        (b'{"prompt": [1, 2], "top_k": 5}', "top_k", "unsupported"),
        (b'{"prompt": [1, 2], "top_k": -5}', "top_k", "unsupported"),
        (b'{"prompt": [1, 2], "min_p": 0.1}', "min_p", "unsupported"),
        (b'{"prompt": [1, 2], "presence_penalty": 1.5}', "presence_penalty", "unsupported"),
        (b'{"prompt": [1, 2], "frequency_penalty": -1}', "frequency_penalty", "unsupported"),
        (b'{"prompt": [1, 2], "repetition_penalty": 1.2}', "repetition_penalty", "unsupported"),
        (b'{"prompt": [1, 2], "logit_bias": {"5": 100}}', "logit_bias", "unsupported"),
        (b'{"prompt": [1, 2], "min_tokens": 3}', "min_tokens", "unsupported"),
        (b'{"prompt": [1, 2], "ignore_eos": true}', "ignore_eos", "unsupported"),
    ],
    ids=[
        "temperature",
        "top_p",
        "vocab",
        "echo",
        "logprobs",
        "best_of",
        "suffix",
        "top_k",
        "top_k_negative",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logit_bias",
        "min_tokens",
        "ignore_eos",
    ],
)
async def test_a_careless_body_is_a_400_with_its_param(
    served: tuple[str, Any],  # noqa: F811
    body: bytes,
    param: str,
    code: str | None,
) -> None:
    url, session = served
    status, got = await raw(session, url, body)
    assert status == 400, got
    assert got["error"]["param"] == param and got["error"]["code"] == code, got
    status, got = await raw(session, url, b'{"prompt": [1, 2], "max_tokens": 1}')
    assert status == 200, got  # still serving


async def test_fields_that_ask_for_nothing_are_accepted(served: tuple[str, Any]) -> None:  # noqa: F811
    """OpenAI clients send the defaults explicitly: they stay fine."""
    url, session = served
    body = (
        b'{"prompt": [1, 2], "max_tokens": 1, "echo": false, "logprobs": null, "best_of": 1, '
        b'"suffix": null, "top_logprobs": 0, "top_k": -1, "min_p": 0, "presence_penalty": 0.0, '
        b'"frequency_penalty": 0, "repetition_penalty": 1.0, "logit_bias": {}, '
        b'"min_tokens": 0, "ignore_eos": false}'
    )
    status, got = await raw(session, url, body)
    assert status == 200, got
    long = b'{"prompt": [' + b",".join([b"1"] * 300) + b"]}"
    status, got = await raw(session, url, long)
    assert (status, got["error"]["code"]) == (400, "context_length_exceeded"), got


async def test_unicode_salts_and_tenant_names(served: tuple[str, Any]) -> None:  # noqa: F811
    """A salt is opaque text: any unicode (a lone surrogate too) is a salt of its UTF-8 bytes,
    and one salt's prefix is never another's; a tenant name outside [A-Za-z0-9_.-] is a 400
    naming the field (this server has no tenants: every name is unknown)."""
    url, session = served
    system = b"[" + b",".join(str(i).encode() for i in range(30, 70)) + b"]"

    async def cached(tail: int, salt: bytes) -> int:
        body = b'{"prompt": ' + system[:-1] + b",%d], " % tail
        body += b'"max_tokens": 1, "temperature": 0, "cache_salt": ' + salt + b"}"
        status, got = await raw(session, url, body)
        assert status == 200, got
        return int(got["usage"]["prompt_tokens_details"]["cached_tokens"])

    # a lone surrogate; é composed, then decomposed (another salt: no normalization merges them)
    for salt in (b'"\\ud800"', '"\u00e9"'.encode(), '"e\u0301"'.encode()):
        assert await cached(1, salt) == 0  # the first of each salt: nothing cached
        assert await cached(2, salt) == 40
        body = b'{"prompt": [1, 2], "max_tokens": 1, "tenant": ' + salt + b"}"
        status, got = await raw(session, url, body)
        assert status == 400 and got["error"]["param"] == "tenant", got
    status, got = await raw(
        session, url, b'{"prompt": [1], "cache_salt": "' + b"\xc3\xa9" * 129 + b'"}'
    )
    assert status == 400 and got["error"]["param"] == "cache_salt", got  # 258 bytes of 129 chars


def test_a_tenants_file_with_api_keys_must_be_private(tmp_path: Path) -> None:
    """The file's API keys are secrets (as ``tierkv serve --tenants``' are): a file group or
    others may read is refused with the reason; quotas alone need no such care."""
    path = tmp_path / "tenants.json"
    path.write_text('{"tenants": {"a": {}}, "api_keys": {"k": "a"}}')
    os.chmod(path, 0o644)
    with pytest.raises(InvalidInputError, match="chmod 600"):
        server.tenant_options(str(path))
    os.chmod(path, 0o600)
    assert server.tenant_options(str(path)) == ({"a": server.Quota()}, {"k": "a"})
    path.write_text('{"tenants": {"a": {}}}')
    os.chmod(path, 0o644)
    assert server.tenant_options(str(path))[0] == {"a": server.Quota()}


@pytest.mark.parametrize(
    "args",
    [
        ["--max-running", "0"],
        ["--device-mb", "nan"],  # int(nan): ValueError
        ["--device-mb", "inf"],  # int(inf): OverflowError
        ["--max-body-mb", "-1"],  # ran, every body refused
        ["--max-tokens", "0"],  # ran, every request refused
        ["--sparse-mean-weight", "2"],
        ["--listen", "nohost"],
        ["--listen", "127.0.0.1:99999"],  # OverflowError at bind
        ["--threads", "0"],  # torch's RuntimeError
        ["--codec", "bogus"],  # UnknownCodecError when the app started
        ["--max-waiting", "0"],
        ["--tenants", "/nonexistent/t.json"],  # SystemExit: one line, but status 1
        ["--trace", "/nonexistent/t.json"],  # served, then a traceback at shutdown
    ],
    ids=lambda a: " ".join(a),
)
def test_a_bad_command_line_is_one_error_line(args: list[str]) -> None:
    import subprocess

    got = subprocess.run(
        [sys.executable, str(Path(server.__file__)), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 2, got.stderr
    assert "error:" in got.stderr and "Traceback" not in got.stderr, got.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["--vocab", "0"],  # ValueError from random
        ["--requests", "0"],  # ran nothing, reported figures of nothing
        ["--concurrency", "0"],
        ["--shared", "2"],
        ["--max-tokens", "0"],  # a RuntimeError traceback of the server's 400
        ["--system", "0", "--user", "0"],
        ["--json", "/nonexistent/x.json"],  # failed after the whole run
    ],
    ids=lambda a: " ".join(a),
)
def test_the_load_generator_refuses_what_cannot_run(args: list[str]) -> None:
    import subprocess

    load = Path(server.__file__).with_name("load.py")
    got = subprocess.run(
        [sys.executable, str(load), *args], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 2, got.stderr
    assert "error:" in got.stderr and "Traceback" not in got.stderr, got.stderr


def test_a_page_too_large_for_the_model_is_one_line_at_startup() -> None:
    """--page-tokens 1000000000 passes the flags' checks (the page's size needs the model's
    dims): the server printed a traceback at startup (SpecError from the engine). Now one
    'error:' line and status 2, as for any bad flag."""
    import subprocess

    script = Path(__file__).parents[2] / "examples" / "server.py"
    args = ["--model", "tiny", "--page-tokens", "1000000000", "--listen", "127.0.0.1:0"]
    done = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "error: KVSpec: a page of" in done.stderr and "Traceback" not in done.stderr
