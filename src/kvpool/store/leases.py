"""The book of what clients hold under leases: reservations, write areas and pins, by id
and by owner.

One :class:`LeaseBook` per kind.  It only keeps the records; the store decides what a lease
means (an abort, an unpin) when one is ended, expires or its owner goes away.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar


class Held(Protocol):
    @property
    def owner(self) -> int: ...

    @property
    def deadline(self) -> float: ...


H = TypeVar("H", bound=Held)


class LeaseBook(Generic[H]):
    def __init__(self) -> None:
        self._id_to_held: dict[int, H] = {}
        self._owner_to_ids: dict[int, set[int]] = {}

    def add(self, id_: int, held: H) -> None:
        self._id_to_held[id_] = held
        self._owner_to_ids.setdefault(held.owner, set()).add(id_)

    def get(self, id_: int, owner: int) -> H | None:
        """The lease ``id_``, if ``owner`` holds it."""
        held = self._id_to_held.get(id_)
        return held if held is not None and held.owner == owner else None

    def pop(self, id_: int, owner: int | None = None) -> H | None:
        """End the lease ``id_`` and return it, if it is held (by ``owner``, when given)."""
        held = self._id_to_held.get(id_)
        if held is None or (owner is not None and held.owner != owner):
            return None
        del self._id_to_held[id_]
        ids = self._owner_to_ids[held.owner]
        ids.discard(id_)
        if not ids:
            del self._owner_to_ids[held.owner]
        return held

    def expired(self, now: float) -> list[tuple[int, H]]:
        return [(i, h) for i, h in self._id_to_held.items() if h.deadline <= now]

    def ids_of(self, owner: int) -> list[int]:
        return list(self._owner_to_ids.get(owner, ()))

    def values(self) -> list[H]:
        return list(self._id_to_held.values())

    def __len__(self) -> int:
        return len(self._id_to_held)
