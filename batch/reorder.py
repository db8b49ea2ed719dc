"""ReorderWindow: results finish in any order; the writer must see them in input order.

Holds the results that finished ahead of an earlier, still-running one; `pop_ready()` releases
the longest run that starts at the next sequence number to write. The runner bounds how many
it holds (it stops admitting records), so memory stays bounded even behind a slow record.
"""
from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ReorderWindow(Generic[T]):
    def __init__(self, first_seq: int = 0) -> None:
        self.next_seq = first_seq
        self._held: dict[int, T] = {}

    @property
    def num_held(self) -> int:
        return len(self._held)

    def put(self, seq: int, item: T) -> None:
        assert seq >= self.next_seq and seq not in self._held, f"sequence {seq} given twice"
        self._held[seq] = item

    def pop_ready(self) -> list[T]:
        ready = []
        while self.next_seq in self._held:
            ready.append(self._held.pop(self.next_seq))
            self.next_seq += 1
        return ready
