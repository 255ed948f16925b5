"""A hand-driven clock for the admission tests, and one tokenizer load for the routers these tests build."""

import copy
import functools

import pytest

import tandem.router.main


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


@pytest.fixture(scope="session", autouse=True)
def routers_load_each_tokenizer_once():
    """The routers built in this process (dozens) read SmolLM2's GGUF vocabulary once, not each time
    (1.5-2 s each on 2 vCPUs: benchmarks/startup.py's tokenizer row). Each router gets its own shallow copy: a test that sets its router's chat
    template changes no other router's; the native tokenizer under it is shared, as a router's threads share it."""
    load_once = functools.cache(tandem.router.main.load_tokenizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tandem.router.main, "load_tokenizer", lambda model: copy.copy(load_once(model)))
        yield
