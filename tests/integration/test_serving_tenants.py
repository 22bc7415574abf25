"""Tenants in the serving engine (issue 29): a tenant's refusal (QuotaExceededError) in a
batched step fails that tenant's requests only; the others in the same step go on, with the
tokens they would have had alone."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tierkv import QuotaExceededError, TenantError
from tierkv.serving import Engine, EngineConfig, SamplingParams, TinyModel
from tierkv.step import StepPlan
from tierkv.tenants import Quota

sys.path.insert(0, str(Path(__file__).parent))
from test_serving import MODEL, one_thread  # noqa: F401 - one torch thread: the box is shared

PAGE_TOKENS = 8
PAGE = 1024  # bytes of one page: K and V, 2 KV heads of 16 dims, 8 tokens, fp16


def engine(**kw: object) -> Engine:
    cfg = EngineConfig(
        **{  # type: ignore[arg-type]
            "page_tokens": PAGE_TOKENS,
            "max_context": 128,
            "max_running": 4,
            "max_batch_tokens": 512,
            "device_bytes": 12 * PAGE,
            "tenants": {"owner": Quota(device_reserve=8 * PAGE), "other": Quota()},
            **kw,
        }
    )
    return Engine(TinyModel(MODEL), cfg)


async def released(e: Engine) -> None:
    """Until the engine's loop let go of its finished requests (at its next turn)."""
    async with asyncio.timeout(10):
        while e.store.sequence_ids():  # noqa: ASYNC110 - no event says so; bounded
            await asyncio.sleep(0.01)


OWNER_CACHED = list(range(1, 34))  # 4 full blocks x 2 layers: the owner's 8 reserved pages
OWNER = list(range(200, 210))  # 2 blocks x 2 layers: 4 new pages (the 4 free ones)
OTHER = list(range(300, 324))  # 3 blocks x 2 layers: 6 new pages, only by taking the owner's


async def test_one_tenants_refusal_in_a_batched_step_fails_only_its_requests() -> None:
    params = SamplingParams(max_tokens=3, temperature=0)
    async with engine(max_running=1) as alone:  # the owner's tokens without the other
        want = (await alone.complete(OWNER, params))[0]
    async with engine() as e:
        await e.complete(OWNER_CACHED, params, tenant="owner")
        await released(e)
        assert e.store.stats()["tenants"]["owner"]["tiers"]["device"]["pages"] == 8
        # both join the same step (prefilled together): the other's pages find no room but
        # the owner's reserved pages; the owner's request is within its quota
        got = await asyncio.gather(
            e.complete(OWNER, params, tenant="owner"),
            e.complete(OTHER, params, tenant="other"),
            return_exceptions=True,
        )
        owner, other = got
        assert isinstance(other, QuotaExceededError), other
        assert other.tenant == "other"
        assert not isinstance(owner, BaseException), owner
        assert owner[0] == want  # the same tokens as alone
        t = e.store.stats()["tenants"]
        assert t["owner"]["tiers"]["device"]["evicted"] == 0
        assert t["other"]["refusals"] >= 1
        assert e.counters.failed == 1
        await released(e)
        e.store.check()


async def test_a_refusal_half_way_through_a_step_goes_on_from_that_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # each layer loads on its own (no prefetch); the other tenant's refusal comes at layer 1
    # of the step both prefill in, after layer 0 appended for both: the owner's rows go on
    # from layer 1 in a new plan and get the tokens they get alone
    params = SamplingParams(max_tokens=3, temperature=0)
    async with engine(max_running=1, prefetch=False) as alone:
        want = (await alone.complete(OWNER, params))[0]
    real = StepPlan.layer
    refused: list[list[str]] = []

    async def layer(self: StepPlan, layer: int) -> object:
        ids = [s.seq_id for s in self.seqs]
        if layer == 1 and len(ids) == 2 and not refused:
            refused.append(ids)
            raise QuotaExceededError("refused for the test", tenant="other")
        return await real(self, layer)

    monkeypatch.setattr(StepPlan, "layer", layer)
    async with engine(prefetch=False, tenants={"owner": Quota(), "other": Quota()}) as e:
        got = await asyncio.gather(
            e.complete(OWNER, params, tenant="owner"),
            e.complete(OTHER, params, tenant="other"),
            return_exceptions=True,
        )
        assert refused, "both requests were never in one step"
        owner, other = got
        assert isinstance(other, QuotaExceededError) and other.tenant == "other"
        assert not isinstance(owner, BaseException), owner
        assert owner[0] == want
        await released(e)
        e.store.check()


async def test_a_bad_or_unknown_tenant_or_salt_is_refused_before_the_request_queues() -> None:
    params = SamplingParams(max_tokens=1, temperature=0)
    async with engine() as e:
        for bad in ("Owner", "nobody", "owner:x", "", 3):
            with pytest.raises(TenantError):  # (UnknownTenantError for the well-formed)
                await e.complete(OWNER, params, tenant=bad)  # type: ignore[arg-type]
        for salt in ("", "x" * 300, 5, bytearray(b"s")):
            with pytest.raises(TenantError):
                await e.complete(OWNER, params, salt=salt, tenant="owner")  # type: ignore[arg-type]
        assert e.waiting == e.running == 0 and e.store.sequence_ids() == []
        assert e.counters.failed == 0
