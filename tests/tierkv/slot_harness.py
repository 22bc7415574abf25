"""A policy bound to a small slot map of its own, driven by keys: the scripted policy tests
read as sequences of inserts, uses and victims, while the policy runs in its one (slot) mode."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tierkv.policies import NO_HINT, EvictionPolicy, Key, PageHint
from tierkv.policies.base import Hints


class Bound:
    """``policy`` bound to ``capacity`` slots; keys are given slots as a page table would
    (a victim's slot is free again at once)."""

    def __init__(self, policy: EvictionPolicy, capacity: int = 64) -> None:
        self.policy = policy
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key] = [None] * capacity
        self.free = list(range(capacity - 1, -1, -1))
        policy.bind_slots(capacity, self.slot_of)

    def insert(self, key: Key, hint: PageHint = NO_HINT) -> None:
        self.insert_many([key], [hint])

    def insert_many(self, keys: Sequence[Key], hints: Hints) -> None:
        slots = [self.free.pop() for _ in keys]
        self.slot_of.update(zip(keys, slots))
        for k, s in zip(keys, slots):
            self.key_of[s] = k
        self.policy.insert_slots(slots, keys, hints)

    def touch(self, key: Key) -> None:
        self.touch_many([key])

    def touch_many(self, keys: Iterable[Key]) -> None:
        keys = list(keys)
        self.policy.touch_slots([self.slot_of[k] for k in keys], keys)

    def remove(self, key: Key) -> None:
        s = self.slot_of.pop(key)
        self.key_of[s] = None
        self.policy.remove_slots([s], [key])
        self.free.append(s)

    def _slot_test(self, can_evict: Callable[[Key], bool] | None) -> Callable[[int], bool] | None:
        if can_evict is None:
            return None
        return lambda s: can_evict(self.key_of[s])

    def evict_many(self, n: int, can_evict: Callable[[Key], bool] | None = None) -> list[Key]:
        slots = self.policy.evict_slots(n, self._slot_test(can_evict))
        keys = [self.key_of[s] for s in slots]
        for k, s in zip(keys, slots):
            del self.slot_of[k]
            self.key_of[s] = None
            self.free.append(s)
        return keys

    def evict(self, can_evict: Callable[[Key], bool] | None = None) -> Key | None:
        out = self.evict_many(1, can_evict)
        return out[0] if out else None

    def candidates(self, n: int, can_evict: Callable[[Key], bool] | None = None) -> list[Key]:
        return [self.key_of[s] for s in self.policy.candidate_slots(n, self._slot_test(can_evict))]

    def admit(self, key: Key, hint: PageHint = NO_HINT) -> bool:
        return self.policy.admit(key, hint)

    def stats(self) -> dict[str, float]:
        return self.policy.stats()

    def __len__(self) -> int:
        return len(self.policy)

    def __contains__(self, key: object) -> bool:
        return key in self.policy

    def __getattr__(self, name: str) -> Any:  # the policy's own (ARC's target, ...)
        return getattr(self.policy, name)
