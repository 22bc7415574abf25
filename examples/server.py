"""An OpenAI-compatible HTTP server over :mod:`tierkv.serving` (aiohttp): continuous batching,
the K/V of every request in a tiered store, a shared prompt prefix computed once.

::

    python examples/server.py --model smollm2 --listen 127.0.0.1:8080     # or --model tiny
    curl -s 127.0.0.1:8080/v1/chat/completions -d '{"model": "smollm2",
         "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 32, "temperature": 0}'
    curl -sN 127.0.0.1:8080/v1/completions -d '{"model": "smollm2", "prompt": "Once upon",
         "stream": true}'
    curl -s 127.0.0.1:8080/metrics                  # Prometheus: the store's and the server's

Routes: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream:
true`` answers server-sent events ending with ``data: [DONE]``), ``GET /health``, ``GET /metrics``
and ``GET /stats`` (the engine's and the store's figures as JSON). Request fields: ``model``,
``prompt`` (text, or token ids) or ``messages``, ``max_tokens``, ``temperature`` (0 = greedy;
default 1 as OpenAI's), ``top_p``, ``seed``, ``stop`` (a string or up to 4), ``stream``,
``cache_salt`` (as vLLM's: a string of 1-256 bytes; the request reuses and shares cached
prefixes only with requests of the same salt, in every tier; docs/security.md, "Tenants"),
``tenant`` (one of ``--tenants``' names; with API keys configured the key names the tenant
instead: ``Authorization: Bearer KEY``, 401 without a known key). A request's tenant is mixed
into its salt (``tierkv.tenant_names.tenant_salt``): no page is shared across tenants, whatever
``cache_salt`` a client sends (another tenant's salt, or none). With API keys, ``/stats``
answers a tenant's key with its own tenant's figures only, and ``/metrics`` needs one of the
``--tenants`` file's ``admin_keys`` (which also read ``/stats`` in full). Fields this server cannot
honour are refused (400) rather than ignored when they ask for something: ``echo``,
``logprobs`` / ``top_logprobs``, ``best_of`` other than 1, ``suffix``, ``top_k`` (other than -1
or 0), ``min_p``, ``presence_penalty`` / ``frequency_penalty`` (other than 0),
``repetition_penalty`` (other than 1), ``logit_bias``, ``min_tokens``, ``ignore_eos``.
``usage.prompt_tokens_details.cached_tokens`` tells how many prompt tokens were reused.

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: 400 for a bad
body (not JSON, a wrong field, a prompt longer than the context or the device tier), 404 for an
unknown model or route, 405, 413 for a body over ``--max-body-mb``, 429 when the store has no
room within the tenants' quotas, 503 when a request's step failed in the store or
``--max-waiting`` requests wait already; a streamed
request that fails after its first token sends an ``error`` event and ends (one refused before
it gets the status, as a request that does not stream).

The cold pool is off by default (``--codec none``): a cached prefix compressed with a lossy codec
comes back approximately, and a warm request's tokens would then differ from a cold computation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import stat
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric

from tierkv import metrics, validate
from tierkv.demo.model import ModelConfig
from tierkv.errors import InvalidInputError, InvalidTypeError, TenantError, TierKVError
from tierkv.serving import (
    ContextLengthError,
    Engine,
    EngineConfig,
    RequestError,
    SamplingParams,
    ServingModel,
    StopText,
    Tokenizer,
    http_status,
    load_model,
)
from tierkv.tenant_names import check_salt, check_tenant, tenant_salt
from tierkv.tenants import Quota


@dataclass(frozen=True)
class ServerConfig:
    """What the server is built from.

    ``model``: ``"smollm2"`` or ``"tiny"`` (``tiny`` sizes its random decoder by ``tiny``);
    ``engine``: the :class:`~tierkv.serving.EngineConfig` (its ``tenants``: the store's
    tenants and quotas); ``max_tokens``: the largest ``max_tokens`` a request may ask (its
    default is 16, OpenAI's); ``api_keys``: API key -> tenant (given, every request needs a
    known key, and the key names its tenant); ``admin_keys``: with ``api_keys``, the keys
    that read every tenant's figures (``/stats`` in full, ``/metrics``); a tenant's key reads
    its own tenant's figures in ``/stats`` only, so no tenant learns what another's traffic
    hits or holds.
    """

    model: str = "tiny"
    tiny: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    max_tokens: int = 1024
    max_body: int = 4 << 20
    trace: str | None = None
    api_keys: Mapping[str, str] = field(default_factory=dict)
    admin_keys: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        validate.count("max_tokens", self.max_tokens, 1)
        validate.count("max_body", self.max_body, 1)
        if not isinstance(self.admin_keys, frozenset) or not all(
            isinstance(k, str) and k for k in self.admin_keys
        ):
            raise InvalidTypeError("admin_keys must be a frozenset of non-empty strings")
        if self.admin_keys & set(self.api_keys):
            raise InvalidInputError("a key is both an admin key and a tenant's API key")


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        """The HTTP response."""
        return web.json_response(self.body(), status=self.status)

    @classmethod
    def of(cls, exc: TierKVError, prefix: str = "") -> ApiError:
        """The answer to a tierkv error: its status from :func:`tierkv.serving.http_status`
        (400 the caller's mistake, 503 not now, 504 a wait ran out, 500 a failure)."""
        status = http_status(exc)
        kind = "invalid_request_error" if status < 500 else "server_error"
        return cls(status, f"{prefix}{exc}", kind)


@dataclass
class Served:
    """The running server's state: the model, its tokenizer and the engine."""

    name: str
    model: ServingModel
    tokenizer: Tokenizer
    engine: Engine
    cfg: ServerConfig
    created: int = field(default_factory=lambda: int(time.time()))


SERVED = web.AppKey("served", Served)


# -- requests -------------------------------------------------------------------------------
@dataclass
class Job:
    """A validated request: prompt ids, sampling, stream or not."""

    prompt: list[int]
    params: SamplingParams
    stream: bool
    chat: bool
    salt: bytes | None = None
    tenant: str | None = None


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    bad_bool = isinstance(value, bool) and bool not in (
        kind if isinstance(kind, tuple) else (kind,)
    )
    if bad_bool or not isinstance(value, kind):
        raise ApiError(400, f"'{name}' has the wrong type", param=name, code="invalid_type")
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    """A JSON number as a float; 400 for another type or an integer past float's range (a
    400-digit literal was an OverflowError, a 500)."""
    value = _field(body, name, (int, float), default)
    try:
        return float(value)
    except OverflowError:
        raise ApiError(400, f"'{name}' is out of range", param=name) from None


#: request fields the server cannot honour, and the values that ask for nothing
_NOT_SUPPORTED = {
    "echo": (False,),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "best_of": (1,),
    "suffix": ("",),
    # vLLM's sampling extensions and OpenAI's penalties: each was ignored silently (a top_k
    # of 5 sampled from the whole vocabulary)
    "top_k": (-1, 0),
    "min_p": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "logit_bias": ({},),
    "min_tokens": (0,),
    "ignore_eos": (False,),
}


def _unsupported(body: dict[str, Any]) -> None:
    """400 for a field that asks for what this server does not do (it was ignored: an
    ``echo`` request got no prompt back, a ``logprobs`` one no log-probabilities)."""
    for name, fine in _NOT_SUPPORTED.items():
        value = body.get(name)
        if value is not None and not any(
            value is x or (type(value) is type(x) and value == x) for x in fine
        ):
            raise ApiError(
                400, f"'{name}' is not supported by this server", param=name, code="unsupported"
            )


def parse_job(body: Any, served: Served, chat: bool) -> Job:
    """Validate a completions or chat body. Raises ApiError (400, or 404 for the model)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    model = body.get("model")
    if model is not None and model not in (served.name, served.cfg.model):
        raise ApiError(
            404,
            f"The model '{model}' does not exist (this server has '{served.name}')",
            param="model",
            code="model_not_found",
        )
    tok = served.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list", param="messages")
        try:
            prompt = tok.chat(messages)
        except (ValueError, TypeError, KeyError) as exc:
            raise ApiError(400, f"bad 'messages': {exc}", param="messages") from None
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, str):
            prompt = tok.encode(raw)
        elif (
            isinstance(raw, list)
            and raw
            and all(isinstance(t, int) and not isinstance(t, bool) for t in raw)
        ):
            prompt = list(raw)
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids", param="prompt")
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt")
    max_tokens = _field(body, "max_tokens", int, 16)
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _field(body, "max_completion_tokens", int, 16)
    if not 1 <= max_tokens <= served.cfg.max_tokens:
        raise ApiError(
            400, f"'max_tokens' must be in [1, {served.cfg.max_tokens}]", param="max_tokens"
        )
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    _unsupported(body)
    seed = _field(body, "seed", int, None)
    stream = _field(body, "stream", bool, False)
    salt = _salt(body)
    n = _field(body, "n", int, 1)
    if n != 1:
        raise ApiError(400, "only n = 1 is supported", param="n")
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        stops = tuple(stop)
    else:
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", param="stop")
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            stop_ids=tok.eos_ids,
            stop=tuple(s for s in stops if s),
        )
        served.engine.check(prompt, params)
    except ContextLengthError as exc:
        raise ApiError(400, str(exc), param="prompt", code="context_length_exceeded") from None
    except RequestError as exc:  # empty, ids outside the vocabulary
        raise ApiError(400, str(exc), param="prompt", code="invalid_prompt") from None
    except TierKVError as exc:  # a bad sampling parameter (InvalidInputError: 400)
        raise ApiError.of(exc) from None
    return Job(prompt, params, stream, chat, salt)


def _bearer(request: web.Request) -> str:
    """The request's ``Authorization: Bearer KEY`` key ("" without one)."""
    auth = request.headers.get("Authorization", "")
    return auth[7:].strip() if auth[:7].lower() == "bearer " else ""  # (the scheme: any case)


#: :func:`_viewer` of a request that reads every tenant's figures
EVERYONE = ""


def _viewer(request: web.Request, served: Served) -> str:
    """Whose figures a ``/stats`` or ``/metrics`` request reads: :data:`EVERYONE` (a server
    without API keys, or an admin key), else the tenant of its API key (401 without a known
    key)."""
    cfg = served.cfg
    if not cfg.api_keys:
        return EVERYONE
    key = _bearer(request)
    if key and key in cfg.admin_keys:
        return EVERYONE
    tenant = cfg.api_keys.get(key) if key else None
    if tenant is None:
        raise ApiError(401, "a known API key is required", code="invalid_api_key")
    return tenant


def _tenant(request: web.Request, body: dict[str, Any], served: Served) -> str | None:
    """The request's tenant: its API key's (when the server has keys: 401 without a known
    one), else its ``tenant`` field, checked against the store's tenants (400)."""
    keys = served.cfg.api_keys
    if keys:
        key = _bearer(request)
        tenant = keys.get(key) if key else None
        if tenant is None:
            raise ApiError(401, "a known API key is required", code="invalid_api_key")
        named = body.get("tenant")
        if named is not None and named != tenant:  # (the key decides: a body that says
            raise ApiError(  # otherwise is refused, not silently overruled)
                400, "'tenant' names another tenant than the API key's", param="tenant"
            )
        return tenant
    raw = body.get("tenant")
    if raw is None:
        return None
    tenants = served.engine.store.tenants
    if not isinstance(raw, str) or tenants is None or raw not in tenants.index:
        raise ApiError(400, f"unknown tenant {raw!r}", param="tenant", code="unknown_tenant")
    return raw


def _salt(body: dict[str, Any]) -> bytes | None:
    """The request's ``cache_salt`` (a string, as vLLM takes it), checked. Raises ApiError
    (400)."""
    raw = body.get("cache_salt")
    if raw is None:
        return None
    if not isinstance(raw, str):
        raise ApiError(
            400, "'cache_salt' must be a string", param="cache_salt", code="invalid_type"
        )
    try:
        return check_salt(raw)
    except TenantError as exc:
        raise ApiError(400, f"bad 'cache_salt': {exc}", param="cache_salt") from None


async def _body(request: web.Request) -> Any:
    try:
        return await request.json()
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError; deep nesting
        raise ApiError(400, "the body is not valid JSON", code="invalid_json") from None


# -- generation -------------------------------------------------------------------------------
@dataclass
class Result:
    """What a finished request sends back."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str = "length"
    ttft: float | None = None
    cached_tokens: int = 0


async def run_job(
    served: Served, job: Job, res: Result, sm: _ServerMetrics
) -> AsyncGenerator[str, None]:
    """Text pieces of a request as they are decoded; ``res`` is filled as it goes.

    Raises ApiError (503) when the engine closes under it, and a failed step's tierkv error."""
    engine, tok = served.engine, served.tokenizer
    text = StopText(tok.decode, job.params.stop)
    t0 = time.perf_counter()
    agen = engine.generate(job.prompt, job.params, salt=job.salt, tenant=job.tenant)
    try:
        async for ev in agen:
            if res.ttft is None:
                res.ttft = time.perf_counter() - t0
                res.cached_tokens = ev.cached_tokens
                sm.ttft.observe(res.ttft)
            if ev.token is not None:
                res.completion_tokens += 1
                piece = text.push(ev.token)
                if piece:
                    yield piece
                if text.stopped:
                    res.finish_reason = "stop"
                    break
            if ev.finish_reason is not None:
                if ev.finish_reason == "abort":
                    raise ApiError(503, "the server is shutting down", "server_error")
                res.finish_reason = "stop" if ev.finish_reason == "stop" else "length"
        rest = text.flush()
        if rest:
            yield rest
    finally:
        await agen.aclose()  # leaving early frees the request's pages
    res.text = text.text
    sm.tokens.inc(res.completion_tokens)


def _usage(job: Job, res: Result) -> dict[str, Any]:
    return {
        "prompt_tokens": len(job.prompt),
        "completion_tokens": res.completion_tokens,
        "total_tokens": len(job.prompt) + res.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": res.cached_tokens},
    }


def _choice(job: Job, text: str, finish: str | None, delta: bool) -> dict[str, Any]:
    if not job.chat:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if delta:
        return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "finish_reason": finish,
    }


async def _completions(request: web.Request, chat: bool) -> web.StreamResponse:
    app = request.app
    served, sm = app[SERVED], app[SERVER_METRICS]
    body = await _body(request)
    job = parse_job(body, served, chat)
    job.tenant = _tenant(request, body, served)
    if job.tenant is not None:  # no page shared across tenants, whatever salt a client sends
        job.salt = tenant_salt(job.tenant, job.salt)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    obj = "chat.completion" if chat else "text_completion"
    head = {"id": rid, "created": int(time.time()), "model": served.name}
    res = Result()
    if not job.stream:
        try:
            async for _ in run_job(served, job, res, sm):
                pass
        except ApiError:
            raise
        except TierKVError as exc:  # a step failed in the store: its status says how
            raise ApiError.of(exc, "generation failed: ") from exc
        except Exception as exc:  # not a library error: still the server's failure
            raise ApiError(503, f"generation failed: {exc}", "server_error") from exc
        return web.json_response(
            {
                **head,
                "object": obj,
                "choices": [_choice(job, res.text, res.finish_reason, False)],
                "usage": _usage(job, res),
            }
        )
    # the first piece before the headers: a request refused before its first token (a
    # tenant's quota, a full queue, a failed prefill) gets its status (429, 503...), not a
    # 200 whose stream holds an error event (which no client or balancer retries on)
    pieces = run_job(served, job, res, sm)
    try:
        opening = await anext(pieces, None)
    except ApiError:
        raise
    except TierKVError as exc:
        raise ApiError.of(exc, "generation failed: ") from exc
    except Exception as exc:
        raise ApiError(503, f"generation failed: {exc}", "server_error") from exc
    try:  # (closed however this ends: leaving early frees the request's pages)
        return await _stream(request, job, res, head, chat, opening, pieces)
    finally:
        await pieces.aclose()


async def _stream(
    request: web.Request,
    job: Job,
    res: Result,
    head: dict[str, Any],
    chat: bool,
    opening: str | None,
    pieces: AsyncGenerator[str, None],
) -> web.StreamResponse:
    """Send a request's text as server-sent events: ``opening``, its first piece (None: the
    request ended without text), then the rest of ``pieces``."""
    obj = "chat.completion" if chat else "text_completion"
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    chunk = obj + ".chunk" if chat else obj

    async def send(payload: dict[str, Any]) -> None:
        await resp.write(f"data: {json.dumps(payload)}\n\n".encode())

    if chat:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        await send({**head, "object": chunk, "choices": [first]})
    try:
        if opening is not None:
            await send({**head, "object": chunk, "choices": [_choice(job, opening, None, True)]})
        async for piece in pieces:
            await send({**head, "object": chunk, "choices": [_choice(job, piece, None, True)]})
        last = _choice(job, "", res.finish_reason, True)
        await send({**head, "object": chunk, "choices": [last], "usage": _usage(job, res)})
    except ApiError as exc:
        await send(exc.body())
    except TierKVError as exc:  # a step failed: tell the client in the stream
        await send(ApiError.of(exc, "generation failed: ").body())
    except Exception as exc:
        await send(ApiError(503, f"generation failed: {exc}", "server_error").body())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def handle_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    return await _completions(request, chat=False)


async def handle_chat(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    return await _completions(request, chat=True)


async def handle_models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    served = request.app[SERVED]
    model = {"id": served.name, "object": "model", "created": served.created, "owned_by": "tierkv"}
    return web.json_response({"object": "list", "data": [model]})


async def handle_health(request: web.Request) -> web.Response:
    """``GET /health``: 200 while the engine runs."""
    engine = request.app[SERVED].engine
    if engine.store.closed:
        raise ApiError(503, "the store is closed", "server_error")
    return web.json_response({"status": "ok", "running": engine.running, "waiting": engine.waiting})


async def handle_stats(request: web.Request) -> web.Response:
    """``GET /stats``: the engine's and the store's figures; with API keys, an admin key's
    request gets them all, a tenant's key its own tenant's figures only."""
    served = request.app[SERVED]
    viewer = _viewer(request, served)
    stats = served.engine.stats()
    if viewer == EVERYONE:
        return web.json_response(stats)
    tenants = stats["store"].get("tenants") or {}
    return web.json_response({"tenant": viewer, **tenants.get(viewer, {})})


async def handle_metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: the store's metrics, then the server's; with API keys, for an admin
    key only (403 for a tenant's: they count every tenant's traffic)."""
    app = request.app
    if _viewer(request, app[SERVED]) != EVERYONE:
        raise ApiError(403, "/metrics needs an admin key", code="admin_key_required")
    body = metrics.render(app[SERVED].engine.store) + generate_latest(app[SERVER_METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- metrics ----------------------------------------------------------------------------------
class _EngineCollector:
    """Gauges read from the engine at scrape time."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def collect(self) -> Iterator[Metric]:
        served = self.app.get(SERVED)
        if served is None:
            return
        e = served.engine
        s = e.stats()
        for name, doc, value in (
            ("running", "Requests running", s["running"]),
            ("waiting", "Requests waiting for admission", s["waiting"]),
            ("peak_running", "Most requests running at once", s["peak_running"]),
            ("device_peak_bytes", "Peak bytes of the device tier", s["store"]["peak_device_bytes"]),
            ("device_capacity_bytes", "Device tier budget", e.device_bytes),
            ("live_kv_peak_bytes", "Peak K/V of the running requests", s["peak_live_kv_bytes"]),
            ("prompt_tokens", "Prompt tokens admitted", s["prompt_tokens"]),
            ("cached_prompt_tokens", "Prompt tokens reused", s["prefix_tokens_reused"]),
            ("generated_tokens", "Tokens generated", s["generated_tokens"]),
            ("steps", "Forward steps", s["steps"]),
            ("decode_tokens", "Tokens after each request's first", s["decode_tokens"]),
            (
                "decode_seconds",
                "Seconds between each of those tokens and its request's previous one",
                s["decode_seconds"],
            ),
        ):
            g = GaugeMetricFamily(f"tierkv_server_{name}", doc)
            g.add_metric([], float(value))
            yield g


class _ServerMetrics:
    """Request counts, time to first token, tokens; the engine's gauges."""

    def __init__(self, app: web.Application) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tierkv_server_requests",
            "HTTP requests by route and status",
            ["route", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "tierkv_server_ttft_seconds",
            "Time to first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=self.registry,
        )
        self.tokens = Counter(
            "tierkv_server_completion_tokens", "Tokens sent to clients", registry=self.registry
        )
        self.registry.register(_EngineCollector(app))


SERVER_METRICS = web.AppKey("server_metrics", _ServerMetrics)


@web.middleware
async def errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every error in OpenAI's shape; counts requests by route and status."""
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "unknown"
    try:
        resp = await handler(request)
    except ApiError as exc:
        resp = exc.response()
    except TierKVError as exc:  # any library error a handler let through: mapped by its kind
        resp = ApiError.of(exc).response()
    except web.HTTPException as exc:  # 404, 405, 413 from aiohttp itself
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        resp = ApiError(exc.status, exc.reason or str(exc), kind).response()
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as exc:  # a bug: still a JSON error, never an HTML page
        resp = ApiError(500, f"internal error: {exc!r}", "server_error").response()
    request.app[SERVER_METRICS].requests.labels(name, str(resp.status)).inc()
    return resp


# -- the app ----------------------------------------------------------------------------------
def make_app(
    cfg: ServerConfig | None = None, loaded: tuple[ServingModel, Tokenizer] | None = None
) -> web.Application:
    """The aiohttp application; the model loads (unless ``loaded`` is given) and the engine
    opens at startup, and the engine closes at cleanup."""
    cfg = cfg or ServerConfig()
    app = web.Application(middlewares=[errors], client_max_size=cfg.max_body)
    app[SERVER_METRICS] = _ServerMetrics(app)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        if loaded is not None:
            model, tok = loaded
        elif cfg.model == "tiny":
            model, tok = load_model("tiny", cfg=cfg.tiny)
        else:
            model, tok = await asyncio.to_thread(load_model, cfg.model)
        engine = Engine(model, cfg.engine)
        await engine.open()
        engine.store.timeline.enabled = cfg.trace is not None
        app[SERVED] = Served(
            cfg.model if cfg.model == "tiny" else model.name, model, tok, engine, cfg
        )
        try:
            yield
        finally:
            await engine.close()
            if cfg.trace:
                engine.store.timeline.write(cfg.trace)

    app.cleanup_ctx.append(lifecycle)
    app.router.add_get("/v1/models", handle_models)
    app.router.add_post("/v1/completions", handle_completions)
    app.router.add_post("/v1/chat/completions", handle_chat)
    app.router.add_get("/health", handle_health)
    app.router.add_get("/metrics", handle_metrics)
    app.router.add_get("/stats", handle_stats)
    return app


async def start(
    cfg: ServerConfig | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    loaded: tuple[ServingModel, Tokenizer] | None = None,
) -> tuple[web.AppRunner, str]:
    """Serve in this process; returns the runner (``await runner.cleanup()`` stops it) and the
    base URL (``port=0``: an ephemeral port)."""
    runner = web.AppRunner(make_app(cfg, loaded), handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addr = runner.addresses[0]
    return runner, f"http://{addr[0]}:{addr[1]}"


def build_parser() -> argparse.ArgumentParser:
    """The command line (documented in docs/configuration.md)."""
    d = EngineConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # (the first sentence)
    p.add_argument(
        "--model",
        choices=["tiny", "smollm2"],
        default="tiny",
        help="tiny: the seeded random decoder; smollm2: SmolLM2-135M-Instruct (extra hf)",
    )
    p.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT (loopback by default)")
    p.add_argument("--max-running", type=int, default=d.max_running, help="concurrency")
    batch = "tokens in one forward at most (decode tokens plus prefill chunks)"
    p.add_argument("--max-batch-tokens", type=int, default=d.max_batch_tokens, help=batch)
    p.add_argument("--max-context", type=int, help="prompt + max_tokens (model's, <= 2048)")
    asked = "the largest max_tokens a request may ask (400 above)"
    p.add_argument("--max-tokens", type=int, default=ServerConfig.max_tokens, help=asked)
    p.add_argument("--page-tokens", type=int, default=d.page_tokens, help="tokens per KV page")
    p.add_argument("--device-mb", type=float, help="device tier (half the concurrency's KV)")
    p.add_argument("--host-mb", type=float, help="host tier (twice the concurrency's KV)")
    p.add_argument("--no-prefix-reuse", action="store_true", help="compute every prompt")
    p.add_argument("--codec", default="none", help="cold-pool codec (none, int8, ...)")
    p.add_argument(
        "--sparse-topk",
        type=int,
        help="decode attends the first page, the --sparse-recent last and this many chosen "
        "by key summaries (off without it)",
    )
    p.add_argument("--sparse-recent", type=int, default=d.sparse_recent, help="with --sparse-topk")
    p.add_argument(
        "--sparse-mean-weight",
        type=float,
        default=d.sparse_mean_weight,
        help="with --sparse-topk: weight in [0, 1) of a page's mean key in its score",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="requests queued at most; more are refused with a 503 (a flood cannot grow it)",
    )
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the model")
    p.add_argument("--trace", metavar="FILE.json", help="write a Chrome trace at shutdown")
    p.add_argument(
        "--tenants",
        metavar="FILE.json",
        help='tenants: {"tenants": {name: {quota fields}}, "api_keys": {key: name}}',
    )
    return p


def _address(text: str) -> tuple[str, int]:
    """``(host, port)`` of ``--listen HOST:PORT`` (int('nohost') was a ValueError, port 99999
    an OverflowError at bind). Raises InvalidInputError."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidInputError(f"--listen must be HOST:PORT with a port in [0, 65535]: {text!r}")
    return host.removeprefix("[").removesuffix("]") or "127.0.0.1", int(port)


def _mib(flag: str, mib: float | None) -> Any:
    """``mib`` MiB in bytes (None stays None). Raises InvalidInputError for a size that is
    not a finite number >= 0 (int(nan) was a ValueError, int(inf) an OverflowError)."""
    if mib is None:
        return None
    if not math.isfinite(mib) or mib < 0:
        raise InvalidInputError(f"{flag} must be a finite number >= 0, got {mib}")
    return int(mib * (1 << 20))


def config_from(a: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` of parsed arguments."""
    quotas, keys, admin = _tenants_file(a.tenants)
    folder = os.path.dirname(os.path.abspath(a.trace)) if a.trace else ""
    if folder and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
        # (a traceback at shutdown, after the whole run, was the first sign)
        raise InvalidInputError(f"--trace {a.trace}: cannot write into {folder}")
    engine = replace(
        EngineConfig(),
        max_running=a.max_running,
        max_batch_tokens=a.max_batch_tokens,
        max_context=a.max_context,
        page_tokens=a.page_tokens,
        device_bytes=_mib("--device-mb", a.device_mb),
        host_bytes=_mib("--host-mb", a.host_mb),
        prefix_reuse=not a.no_prefix_reuse,
        codec=None if a.codec == "none" else a.codec,
        tenants=quotas or None,
        sparse_topk=a.sparse_topk,
        sparse_recent=a.sparse_recent,
        sparse_mean_weight=a.sparse_mean_weight,
        max_waiting=a.max_waiting,
    )
    return ServerConfig(
        model=a.model,
        engine=engine,
        max_tokens=a.max_tokens,
        max_body=_mib("--max-body-mb", a.max_body_mb),
        trace=a.trace,
        api_keys=keys,
        admin_keys=admin,
    )


#: the largest ``--tenants`` file read (bytes)
MAX_TENANTS_FILE = 1 << 20


def _no_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict; a name twice is an error (not the last one silently)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        twice = sorted({k for k, _ in pairs if sum(1 for j, _ in pairs if j == k) > 1})
        raise ValueError(f"{twice} given twice")
    return out


def tenant_options(path: str | None) -> tuple[dict[str, Quota], dict[str, str]]:
    """The quotas and API keys of a ``--tenants`` file: ``{"tenants": {name:
    {"device_reserve": bytes, "host_limit": bytes, ...}}, "api_keys": {key: name},
    "admin_keys": [key, ...]}`` (the keys' tenants must be among the names; the admin keys,
    optional, read every tenant's figures: :func:`_tenants_file`). Raises InvalidInputError
    with the reason for a bad file (it was SystemExit: status 1 where every other bad flag is
    2): not a regular file of at most ``MAX_TENANTS_FILE`` bytes of JSON, a name or key twice,
    a bad tenant name, a bad quota, an API key that is not a non-empty string, API keys in a
    file that group or others may read, admin keys that are not a list of non-empty strings,
    one that is a tenant's key, admin keys without API keys."""
    quotas, keys, _ = _tenants_file(path)
    return quotas, keys


def _tenants_file(path: str | None) -> tuple[dict[str, Quota], dict[str, str], frozenset[str]]:
    """:func:`tenant_options` and the file's admin keys (``"admin_keys"``: a list of
    non-empty strings, none of them a tenant's API key; only beside ``"api_keys"``)."""
    if path is None:
        return {}, {}, frozenset()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO: no wait for a writer)
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise ValueError("not a regular file")
            raw = f.read(MAX_TENANTS_FILE + 1)
        if len(raw) > MAX_TENANTS_FILE:
            raise ValueError(f"over {MAX_TENANTS_FILE} bytes")
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_twice)
        if not isinstance(doc, dict):
            raise ValueError("want a JSON object")
        quotas = {check_tenant(name): Quota(**q) for name, q in doc.get("tenants", {}).items()}
        keys = doc.get("api_keys", {})
        if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in keys.items()):
            raise ValueError("api_keys: want non-empty string keys and tenant names")
        admin = doc.get("admin_keys", [])
        if not isinstance(admin, list) or not all(isinstance(k, str) and k for k in admin):
            raise ValueError("admin_keys: want a list of non-empty strings")
        if admin and not keys:
            raise ValueError("admin_keys without api_keys (a server without keys is open)")
        if set(admin) & set(keys):
            raise ValueError("a key is both in admin_keys and in api_keys")
        if keys and mode & 0o077:  # (as tierkv serve's secrets file)
            raise ValueError("it holds API keys and group or others may read it (chmod 600)")
    except (OSError, ValueError, TypeError, AttributeError, RecursionError, TierKVError) as exc:
        raise InvalidInputError(f"--tenants {path}: {exc}") from None
    unknown = sorted(set(keys.values()) - set(quotas))
    if unknown:
        raise InvalidInputError(f"--tenants {path}: API keys name unknown tenants {unknown}")
    return quotas, keys, frozenset(admin)


def main() -> None:
    p = build_parser()
    a = p.parse_args()
    try:  # a bad value is one "error:" line and status 2, never a traceback
        cfg = config_from(a)
        validate.count("--threads", a.threads, 1)
        host, port = _address(a.listen)
    except TierKVError as exc:
        p.error(str(exc))
    import torch

    torch.set_num_threads(a.threads)
    # a client that hangs up cancels its handler, and with it the request (its pages freed)
    app = make_app(cfg)
    try:  # what only the model's size tells (a page over 1 GiB...): one line too, at startup
        web.run_app(app, host=host, port=port, handler_cancellation=True)
    except TierKVError as exc:
        p.exit(2, f"{p.prog}: error: {exc}\n")


if __name__ == "__main__":
    main()
