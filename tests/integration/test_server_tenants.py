"""Tenants in the example server (issue 29): ``cache_salt`` as vLLM's OpenAI server takes it
(a request reuses cached prefixes of its own salt only), bad salts are 400s."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from test_server import MODEL, one_thread, post, served  # noqa: E402, F401


async def test_cache_salt_separates_cached_prefixes(served: tuple[str, Any]) -> None:  # noqa: F811
    url, session = served
    rnd = random.Random(7)
    system = [rnd.randrange(MODEL.vocab) for _ in range(40)]
    req = {"max_tokens": 2, "temperature": 0}

    async def cached(tail: int, salt: str | None) -> int:
        body = {**req, "prompt": system + [tail]}
        if salt is not None:
            body["cache_salt"] = salt
        status, got = await post(session, url, "/v1/completions", body)
        assert status == 200, got
        return int(got["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert await cached(1, "alice") == 0
    assert await cached(2, "alice") == 40  # her own prefix
    assert await cached(3, "bob") == 0  # the same prompt under another salt: no hit
    assert await cached(4, None) == 0  # nor without one
    assert await cached(5, "bob") == 40  # bob's own, computed above
    for bad in ("", "x" * 300, 5, ["alice"]):
        status, got = await post(
            session, url, "/v1/completions", {**req, "prompt": system, "cache_salt": bad}
        )
        assert status == 400 and got["error"]["param"] == "cache_salt", (bad, got)
