"""The engine thread's hand-off: when a step fails, every caller gets EngineDeadError; none waits forever."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from starlette.testclient import TestClient

from tandem.config import EngineConfig, WorkerConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams
from tandem.workers.async_engine import AsyncEngine, EngineDeadError
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.models.loader import load_model
from tandem.workers.server import ServingContext, build_app


def test_a_failed_step_fails_streams_and_calls_and_later_calls_at_once(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=16), EngineMetrics(loaded.config.name, "both"))

    def broken_step():
        raise RuntimeError("a bug in a step")

    engine.step = broken_step
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def run():
        stream = async_engine.generate("r1", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4), 0.0)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):  # the kv/release path: it must not wait for a thread that is gone
            await asyncio.wait_for(async_engine.call(lambda e: e.release_lease("nothing")), 5)

    try:
        asyncio.run(run())
    finally:
        async_engine.stop()


def test_a_step_that_never_returns_turns_health_and_ready_to_503_until_it_does(tiny_llama_dir):
    """A hung GPU call or a deadlock leaves the engine thread alive: the stall watch is what lets Kubernetes'
    liveness probe restart the pod and the routers' /ready polls take the worker out."""
    loaded = load_model(tiny_llama_dir, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=16), EngineMetrics(loaded.config.name, "both"))
    release = threading.Event()
    real_step = engine.step

    def hung_step():
        release.wait(30)
        return real_step()

    engine.step = hung_step
    async_engine = AsyncEngine(engine)
    config = WorkerConfig(stall_timeout_s=0.3)
    ctx = ServingContext(async_engine, loaded.tokenizer, "tiny", engine.max_model_len, config,
                         engine.metrics, engine.layout, None)
    async_engine.start()
    try:
        with TestClient(build_app(ctx)) as http:
            _watch_a_hung_step(http, release)
    finally:
        release.set()
        async_engine.stop()


def _watch_a_hung_step(http: TestClient, release: threading.Event) -> None:
    answer = None
    try:
        assert http.get("/health").status_code == 200  # idle: waiting for work is not a stall
        time.sleep(0.5)
        assert http.get("/health").status_code == 200
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        answer = threading.Thread(target=lambda: http.post("/v1/completions", json=body))
        answer.start()
        deadline = time.monotonic() + 10
        while http.get("/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health, ready = http.get("/health"), http.get("/ready")
        assert health.status_code == 503 and "engine step has run for" in health.json()["error"]["message"]
        assert ready.status_code == 503 and "stall timeout 0.3 s" in ready.json()["error"]["message"]
        release.set()
        answer.join(30)
        assert not answer.is_alive()
        assert http.get("/health").status_code == 200 and http.get("/ready").status_code == 200
    finally:  # the request ends before the client closes, which would wait on it for good
        release.set()
        if answer is not None:
            answer.join(30)


def test_the_engine_steps_on_while_a_requests_grammar_compiles(tiny_llama_dir):
    """Some schemas take seconds to compile: a worker compiled them on the engine thread, and every running stream
    stopped meanwhile (found by a robustness-testing helper). The compile below finishes only once
    another stream has moved on 20 tokens: compiled on the engine thread, it would wait for good."""
    from tandem.protocol import StructuredOutput
    from tandem.workers.engine import grammar as grammar_module

    loaded = load_model(tiny_llama_dir, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=16), EngineMetrics(loaded.config.name, "both"))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    other_moved_on = threading.Event()
    compile_before = grammar_module._compiled

    def slow_compile(*args):
        if not other_moved_on.wait(30):
            raise ValueError("the engine did not step while a grammar compiled")
        return compile_before(*args)

    async def run():
        async def other():
            outputs = 0
            async for _ in async_engine.generate("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=60,
                                                                                     ignore_eos=True), 0.0):
                outputs += 1
                if outputs == 20:
                    other_moved_on.set()

        plain = asyncio.create_task(other())
        structured = SamplingParams(temperature=0, max_tokens=3, structured=StructuredOutput(kind="regex",
                                                                                             value="[0-9]+"))
        outputs = [o async for o in async_engine.generate("structured", [5, 6, 7], structured, 0.0)]
        await plain
        return outputs

    grammar_module._compiled = slow_compile
    try:
        outputs = asyncio.run(run())
    finally:
        grammar_module._compiled = compile_before
        async_engine.stop()
    assert outputs[-1].finished and other_moved_on.is_set()


def test_an_engine_that_dies_while_a_grammar_compiles_fails_that_request_too(tiny_llama_dir):
    """The compile is awaited before the request's stream is registered: a stream registered after the dying engine
    thread failed the ones it knew would wait for good (found by a review helper)."""
    from tandem.protocol import StructuredOutput
    from tandem.workers.engine import grammar as grammar_module

    loaded = load_model(tiny_llama_dir, dtype="float32")
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=32, block_size=16), EngineMetrics(loaded.config.name, "both"))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    engine_died = threading.Event()

    def broken_step():
        raise RuntimeError("a bug in a step")

    compile_before = grammar_module._compiled

    def compile_while_it_dies(*args):
        engine.step = broken_step
        async_engine._inbox.put(_add_plain_request())  # gives the engine a step to fail
        async_engine._wakeup.set()
        engine_died.wait(30)
        return compile_before(*args)

    def _add_plain_request():
        from tandem.workers.async_engine import _Add

        return _Add("plain", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4), 0.0, {})

    async def run():
        params = SamplingParams(temperature=0, max_tokens=3, structured=StructuredOutput(kind="regex", value="[0-9]+"))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_drain(async_engine.generate("structured", [5, 6, 7], params, 0.0)), 30)

    async def _drain(stream):
        async for _ in stream:
            pass

    def watch():
        while async_engine.error is None:
            time.sleep(0.01)
        engine_died.set()

    grammar_module._compiled = compile_while_it_dies
    threading.Thread(target=watch, daemon=True).start()
    try:
        asyncio.run(run())
    finally:
        grammar_module._compiled = compile_before
        async_engine.stop()
