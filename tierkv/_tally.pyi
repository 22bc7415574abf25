"""Type stub of the tenants' per-batch count (tierkv/_tally.c, built where a compiler is)."""

from collections.abc import Hashable, Sequence

def tally(
    of: dict[Hashable, int],
    keys: Sequence[Hashable],
    nobody: int,
    plus: list[int] | None,
    minus: list[int] | None,
    /,
) -> int: ...
