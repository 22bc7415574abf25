"""A step's padded gather (``LayerStep.kv_padded``, the serving engine's one read per layer):
every sequence's K/V exactly as appended, padded to the longest with its own last token, into
a caller's buffer without allocating; a bad buffer raises the typed error before anything is
read; the rows of ragged sequences through loads and evictions."""

from __future__ import annotations

import pytest
import torch

from tierkv import SequenceError, SpecError
from tierkv.errors import InvalidTypeError

from .test_step import SPEC, D, H, idle, rand, store


def check_padded(kp: torch.Tensor, vp: torch.Tensor, refs: list[torch.Tensor]) -> None:
    """``kp``/``vp`` ``[B, H, S_max, D]`` hold each reference (K; V is K + 1) then its last
    token repeated."""
    smax = max(r.shape[1] for r in refs)
    assert kp.shape == vp.shape == (len(refs), H, smax, D)
    for b, ref in enumerate(refs):
        s = ref.shape[1]
        assert torch.equal(kp[b, :, :s], ref) and torch.equal(vp[b, :, :s], ref + 1)
        if s:
            pad = ref[:, -1:].expand(H, smax - s, D)
            assert torch.equal(kp[b, :, s:], pad) and torch.equal(vp[b, :, s:], pad + 1)


@pytest.mark.parametrize("ahead", [0, 2])
async def test_padded_rows_are_the_appended_kv_through_loads_and_evictions(ahead: int) -> None:
    ids = ["x", "y", "z"]
    ref: dict[tuple[str, int], torch.Tensor] = {}
    async with store(device_pages=30) as st:
        for s in ids:
            await st.add_sequence(s, [])
        buf = torch.full((4096,), float("nan"))
        steps = [[3, 9, 1], [1, 1, 1], [0, 6, 2], [5, 1, 1], [1, 1, 1], [2, 2, 2]]
        for n_step, counts in enumerate(steps):
            async with st.step_plan(ids, tokens=counts, ahead=ahead) as step:
                for layer in range(SPEC.num_layers):
                    h = await step.layer(layer)
                    k = rand(H, sum(counts), D, seed=10 * n_step + layer)
                    h.append(k, k + 1)
                    for s, part in zip(ids, k.split(counts, dim=1)):
                        have = ref.get((s, layer), torch.empty(H, 0, D))
                        ref[(s, layer)] = torch.cat([have, part], 1)
                    refs = [ref[(s, layer)] for s in ids]
                    assert h.lengths == [r.shape[1] for r in refs]
                    check_padded(*h.kv_padded(), refs)  # a fresh tensor
                    kp, vp = h.kv_padded(out=buf)  # into the caller's buffer
                    assert kp.data_ptr() == buf.data_ptr()
                    check_padded(kp, vp, refs)
                    if len(set(h.lengths)) == 1:  # no padding: kv()'s tensors exactly
                        k_all, v_all = h.kv()
                        assert torch.equal(k_all, kp) and torch.equal(v_all, vp)
            st.step()
            await idle(st)
        assert st.stats()["page_loads"] > 0


async def test_a_bad_buffer_raises_before_anything_is_read() -> None:
    async with store() as st:
        await st.add_sequence("a", [])
        await st.add_sequence("b", [])
        async with st.step_plan(["a", "b"], tokens=[2, 3]) as step:
            h = await step.layer(0)
            with pytest.raises(SequenceError, match="append"):
                h.kv_padded()  # nothing appended yet
            h.append(rand(H, 5, D, seed=1), rand(H, 5, D, seed=2))
            need = 2 * 2 * H * 3 * D
            for bad in (
                torch.zeros(need - 1),  # too small
                torch.zeros(need, dtype=torch.float64),  # wrong dtype
                torch.zeros(2 * need)[::2],  # not contiguous
                torch.zeros(need, device="meta"),  # wrong device
            ):
                before = bad.clone() if bad.device.type != "meta" else None
                with pytest.raises(SpecError):
                    h.kv_padded(out=bad)
                if before is not None:
                    assert torch.equal(bad, before)
            with pytest.raises(InvalidTypeError):
                h.kv_padded(out=[0.0] * need)  # type: ignore[arg-type]
            kp, _ = h.kv_padded(out=torch.zeros(need))
            assert kp.shape == (2, H, 3, D)
            h1 = await step.layer(1)
            with pytest.raises(SequenceError, match="no longer current"):
                h.kv_padded()
            h1.append(rand(H, 5, D, seed=3), rand(H, 5, D, seed=4))
        await idle(st)


async def test_a_sequence_with_no_tokens_pads_with_real_rows() -> None:
    async with store(device_pages=40) as st:
        await st.add_sequence("empty", [])
        await st.add_sequence("full", [])
        async with st.step_plan(["empty", "full"], tokens=[0, 3], ahead=0) as step:
            for layer in range(SPEC.num_layers):
                h = await step.layer(layer)
                k = rand(H, 3, D, seed=layer)
                h.append(k, k + 1)
                kp, vp = h.kv_padded()
                assert h.lengths == [0, 3]
                assert kp.shape == (2, H, 3, D) and torch.isfinite(kp).all()
                check_padded(kp[1:], vp[1:], [k])
        await idle(st)
