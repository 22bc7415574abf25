"""Every async test runs twice: under asyncio in debug mode and under uvloop (when installed).

Hypothesis runs under a profile chosen by ``HYPOTHESIS_PROFILE``:

* ``ci`` (the default): derandomized, no example database, so a run can never pass by luck;
* ``dev``: random examples, as hypothesis does by default;
* ``long``: random, at least ``HYPOTHESIS_LONG_EXAMPLES`` (default 100,000) examples for every
  property test, whatever its own ``max_examples`` (the rare-case hunt; see
  docs/benchmarks.md for its last figures).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping
from typing import Any

from hypothesis import HealthCheck, settings

LONG_EXAMPLES = int(os.environ.get("HYPOTHESIS_LONG_EXAMPLES", "100000"))
settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.register_profile(
    "long",
    max_examples=LONG_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Under the ``long`` profile, raise every property test's own ``max_examples``."""
    if PROFILE != "long":
        return
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is not None and isinstance(getattr(cls, "settings", None), settings):
            cls.settings = settings(cls.settings, max_examples=LONG_EXAMPLES)  # stateful tests
        fn = getattr(item, "obj", None)
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if isinstance(own, settings):
            fn._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
                own, max_examples=LONG_EXAMPLES, deadline=None
            )


def _asyncio_debug_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    loop.set_debug(True)
    return loop


def pytest_asyncio_loop_factories(config: Any, item: Any) -> Mapping[str, Callable[[], Any]]:
    factories: dict[str, Callable[[], Any]] = {"asyncio": _asyncio_debug_loop}
    try:
        import uvloop
    except ImportError:
        return factories
    factories["uvloop"] = uvloop.new_event_loop
    return factories
