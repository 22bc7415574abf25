"""Which sequences are in an entered step plan (:mod:`tierkv.step`): a sequence runs in at most
one plan at a time. Two plans over one sequence would both open its next pages and both
append to it; the second plan's entry raises SequenceError instead, before anything is held
or changed. One per store (:class:`tierkv.store.KVStore`); the plans take and free their
sequences here."""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.errors import SequenceError
from tierkv.sequence import SequenceState

__all__ = ["StepClaims"]


class StepClaims:
    """The sequences held by entered step plans (by identity: a released id's new sequence
    is another sequence)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[int, SequenceState] = {}  # id(seq) -> seq (the reference keeps id)

    def __contains__(self, seq: SequenceState) -> bool:
        return self._held.get(id(seq)) is seq

    def __len__(self) -> int:
        return len(self._held)

    def claim(self, seqs: Sequence[SequenceState]) -> None:
        """Take ``seqs`` for a plan. Raises SequenceError, taking none, when one is in another
        plan already."""
        held = self._held
        for seq in seqs:
            if held.get(id(seq)) is seq:
                raise SequenceError(f"sequence {seq.seq_id!r} is in another step plan")
        for seq in seqs:
            held[id(seq)] = seq

    def free(self, seqs: Sequence[SequenceState]) -> None:
        """Let go of ``seqs`` (a plan's, taken by :meth:`claim`)."""
        held = self._held
        for seq in seqs:
            if held.get(id(seq)) is seq:
                del held[id(seq)]
