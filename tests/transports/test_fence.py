"""transports/fence.py: a write fence is done only once the writes let in before it have
ended (landed, or their connection dropped), whatever else lands meanwhile."""

from __future__ import annotations

from tierkv.transports.fence import Landing


async def test_a_fence_waits_for_the_writes_landing_when_it_was_raised() -> None:
    landing = Landing()
    a1, a2, b = object(), object(), object()
    landing.started(a1, "a")
    landing.started(b, "b")
    assert landing.fence("c").done()  # nothing of c's is landing
    fa, fall = landing.fence("a"), landing.fence(None)
    assert not fa.done() and not fall.done()
    landing.started(a2, "a")  # a later write of a's: guarded anew, not waited for
    landing.ended(a2)
    assert not fa.done()
    landing.ended(a1)  # landed
    assert fa.done() and not fall.done()
    landing.ended(b)  # its connection dropped mid-payload
    assert fall.done() and landing.landing == 0
    landing.ended(b)  # twice: nothing
