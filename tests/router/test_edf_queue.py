"""The bounded earliest-deadline-first queue."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.router.admission.edf_queue import EDFQueue, QueueFullError

entries = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 2)), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(entries=entries)
def test_pops_by_deadline_then_priority_then_arrival(entries):
    queue: EDFQueue[int] = EDFQueue(max_size=100)
    for index, (deadline, priority) in enumerate(entries):
        queue.push(f"r{index}", index, float(deadline), priority)
    expected = sorted(range(len(entries)), key=lambda i: (entries[i][0], -entries[i][1], i))
    assert list(queue) == expected  # iteration shows the order without consuming it
    assert [queue.pop() for _ in range(len(entries))] == expected
    assert len(queue) == 0


@settings(max_examples=60, deadline=None, derandomize=True)
@given(entries=entries, new=st.tuples(st.integers(0, 20), st.integers(0, 2)))
def test_ahead_of_is_what_pops_before_a_newcomer(entries, new):
    queue: EDFQueue[int] = EDFQueue(max_size=100)
    for index, (deadline, priority) in enumerate(entries):
        queue.push(f"r{index}", index, float(deadline), priority)
    ahead = list(queue.ahead_of(float(new[0]), new[1]))
    queue.push("new", -1, float(new[0]), new[1])
    order = list(queue)
    assert ahead == order[: order.index(-1)]


def test_bounded_and_removable():
    queue: EDFQueue[str] = EDFQueue(max_size=3)
    for name, deadline in (("a", 3.0), ("b", 1.0), ("c", 2.0)):
        queue.push(name, name, deadline)
    assert queue.full and len(queue) == 3
    with pytest.raises(QueueFullError):
        queue.push("d", "d", 0.0)
    assert queue.remove("c") == "c" and "c" not in queue
    assert queue.remove("c") is None
    queue.push("d", "d", 0.5)
    assert queue.peek() == "d"
    assert [queue.pop() for _ in range(3)] == ["d", "b", "a"]
    with pytest.raises(IndexError):
        queue.pop()
    with pytest.raises(IndexError):
        queue.peek()


def test_bad_input():
    with pytest.raises(ValueError, match="max_size"):
        EDFQueue(0)
    queue: EDFQueue[int] = EDFQueue(2)
    queue.push("a", 1, 1.0)
    with pytest.raises(ValueError, match="already queued"):
        queue.push("a", 2, 2.0)
    with pytest.raises(ValueError, match="NaN"):
        queue.push("b", 2, float("nan"))
