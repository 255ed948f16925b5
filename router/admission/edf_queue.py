"""A bounded earliest-deadline-first queue."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueFullError(Exception):
    """push() on a queue already holding max_size items."""


class EDFQueue(Generic[T]):
    """Items leave in order of deadline, then higher priority, then arrival.

    Kept as a sorted list rather than a heap: the queue is bounded (a long queue means requests that will
    miss their deadline anyway), and admission needs the items ahead of a would-be newcomer in order, and
    removal of cancelled requests, which a sorted list gives directly.
    """

    def __init__(self, max_size: int):
        if max_size < 1:
            raise ValueError(f"max_size must be >= 1, got {max_size}")
        self.max_size = max_size
        self._keys: list[tuple[float, int, int]] = []  # (deadline, -priority, arrival sequence number)
        self._ids: list[str] = []
        self._items: dict[str, T] = {}
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, item_id: object) -> bool:
        return item_id in self._items

    def __iter__(self) -> Iterator[T]:
        """Items in the order pop() would return them."""
        return (self._items[i] for i in list(self._ids))

    @property
    def full(self) -> bool:
        return len(self._ids) >= self.max_size

    def push(self, item_id: str, item: T, deadline_s: float, priority: int = 0) -> None:
        if item_id in self._items:
            raise ValueError(f"{item_id!r} is already queued")
        if math.isnan(deadline_s):
            raise ValueError(f"{item_id!r}: deadline is NaN")
        if self.full:
            raise QueueFullError(f"queue holds its maximum of {self.max_size} items")
        key = (deadline_s, -priority, next(self._arrivals))
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._ids.insert(index, item_id)
        self._items[item_id] = item

    def peek(self) -> T:
        if not self._ids:
            raise IndexError("peek at an empty queue")
        return self._items[self._ids[0]]

    def pop(self) -> T:
        if not self._ids:
            raise IndexError("pop from an empty queue")
        del self._keys[0]
        return self._items.pop(self._ids.pop(0))

    def remove(self, item_id: str) -> T | None:
        """Take an item out wherever it is (a cancelled request); None when it is not queued."""
        if item_id not in self._items:
            return None
        index = self._ids.index(item_id)
        del self._keys[index]
        del self._ids[index]
        return self._items.pop(item_id)

    def ahead_of(self, deadline_s: float, priority: int = 0) -> Iterator[T]:
        """The items that would still leave before an item pushed now with this deadline and priority."""
        end = bisect.bisect_left(self._keys, (deadline_s, -priority, math.inf))
        return (self._items[i] for i in self._ids[:end])
