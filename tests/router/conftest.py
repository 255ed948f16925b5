"""A hand-driven clock for the admission tests."""

import pytest


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def make_clock():
    """FakeClock itself, for hypothesis tests that need a fresh clock per generated example."""
    return FakeClock
