"""Who may append to a sequence now: one writer per (sequence, layer) at a time.

Two writers of one sequence's layer would interleave their appends (each append is whole, but
the tokens of two steps would alternate in one layer's KV). So:

- a step plan (:mod:`tierkv.step`) appends to every sequence it names a token count for (in
  every layer it names): it takes them at entry, and its entry raises SequenceError, before
  anything is held or changed, when a sequence is in another entered plan (whether either
  appends to it or not: a sequence runs in one plan at a time), or, when the plan appends
  to it, in an entered lease over one of its layers;
- a lease (:mod:`tierkv.lease`) may append, or only read: it is recorded at entry, and its
  entry raises SequenceError when a sequence is in an entered plan appending to one of its
  layers;
- two leases of one sequence may be entered at once (readers, or layer-wise writers of
  different layers): the first to append to a layer takes it until its exit, and another
  lease's append to that layer raises SequenceError, nothing appended.

The first writer is never affected: the refusal goes to the second. One per store
(:class:`tierkv.store.KVStore`); the plans and leases take and free their entries here.
Sequences are held by identity (a released id's new sequence is another sequence).
"""

from __future__ import annotations

from collections.abc import Sequence

from tierkv.errors import SequenceError
from tierkv.sequence import SequenceState

__all__ = ["StepClaims"]


def _layers(bits: int) -> list[int]:
    """The layers of ``bits`` (>= 0)."""
    return [i for i in range(bits.bit_length()) if bits >> i & 1]


def _union(masks: Sequence[int]) -> int:
    out = 0
    for m in masks:
        out |= m
    return out


class StepClaims:
    """The sequences held by entered step plans and leases, and the layers leases append to
    (by identity: the entries keep their sequences alive, so an ``id`` is not reused)."""

    __slots__ = ("_held", "_leased", "_writing")

    def __init__(self) -> None:
        # id(seq) -> (seq, the layers its plan appends to, as bits)
        self._held: dict[int, tuple[SequenceState, int]] = {}
        # id(seq) -> (seq, the layers of each entered lease over it, as bits)
        self._leased: dict[int, tuple[SequenceState, list[int]]] = {}
        # (id(seq), layer) -> id of the lease appending to it
        self._writing: dict[tuple[int, int], int] = {}

    def __contains__(self, seq: SequenceState) -> bool:
        """Whether ``seq`` is in an entered step plan."""
        got = self._held.get(id(seq))
        return got is not None and got[0] is seq

    def __len__(self) -> int:
        """Sequences in entered step plans."""
        return len(self._held)

    def claim(self, seqs: Sequence[SequenceState], layers: Sequence[int]) -> None:
        """Take ``seqs`` for a plan that appends to ``layers[i]`` (bits; 0: a sequence it
        appends no token to, read only) of ``seqs[i]``. Raises SequenceError, taking none,
        when one is in another plan, or in an entered lease over one of the layers the plan
        appends to."""
        held, leased = self._held, self._leased
        for seq, bits in zip(seqs, layers, strict=True):
            got = held.get(id(seq))
            if got is not None and got[0] is seq:
                raise SequenceError(f"sequence {seq.seq_id!r} is in another step plan")
            lease = leased.get(id(seq))
            if bits and lease is not None and lease[0] is seq and any(b & bits for b in lease[1]):
                raise SequenceError(
                    f"sequence {seq.seq_id!r} is in an entered lease (layers "
                    f"{_layers(bits & _union(lease[1]))}): a step plan appends to it, and one "
                    "writer at a time may (leave the lease first)"
                )
        for seq, bits in zip(seqs, layers):
            held[id(seq)] = (seq, bits)

    def free(self, seqs: Sequence[SequenceState]) -> None:
        """Let go of ``seqs`` (a plan's, taken by :meth:`claim`)."""
        held = self._held
        for seq in seqs:
            got = held.get(id(seq))
            if got is not None and got[0] is seq:
                del held[id(seq)]

    def enter_lease(self, seqs: Sequence[SequenceState], layers: int) -> None:
        """Record a lease over ``seqs`` and ``layers`` (bits). Raises SequenceError, recording
        nothing, when one is in an entered step plan over one of ``layers``."""
        held, leased = self._held, self._leased
        for seq in seqs:
            got = held.get(id(seq))
            if got is not None and got[0] is seq and got[1] & layers:
                raise SequenceError(
                    f"sequence {seq.seq_id!r} is in an entered step plan (layers "
                    f"{_layers(got[1] & layers)}): it appends to them, and one writer at a "
                    "time may (lease it once the step is done)"
                )
        for seq in seqs:
            entry = leased.get(id(seq))
            if entry is None or entry[0] is not seq:
                leased[id(seq)] = (seq, [layers])
            else:
                entry[1].append(layers)

    def leave_lease(self, lease: int, seqs: Sequence[SequenceState], layers: int) -> None:
        """Drop a lease's record (taken by :meth:`enter_lease`) and the layers it appended
        to (``lease``: its id, as given to :meth:`write`)."""
        leased, writing = self._leased, self._writing
        for seq in seqs:
            entry = leased.get(id(seq))
            if entry is not None and entry[0] is seq:
                entry[1].remove(layers)
                if not entry[1]:
                    del leased[id(seq)]
        if writing:
            for seq in seqs:
                for layer in _layers(layers):
                    if writing.get((id(seq), layer)) == lease:
                        del writing[(id(seq), layer)]

    def write(self, lease: int, seq: SequenceState, layer: int) -> None:
        """Lease ``lease`` (its id) appends to ``seq``'s ``layer``: it takes the layer until
        it leaves. Raises SequenceError when another entered lease took it."""
        key = (id(seq), layer)
        holder = self._writing.setdefault(key, lease)
        if holder != lease:
            raise SequenceError(
                f"sequence {seq.seq_id!r} layer {layer}: another entered lease appends to it, "
                "and one writer at a time may (nothing was appended)"
            )
