"""The engine thread's hand-off: when a step fails, every caller gets EngineDeadError; none waits forever."""

from __future__ import annotations

import asyncio

import pytest

from tandem.config import EngineConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams
from tandem.workers.async_engine import AsyncEngine, EngineDeadError
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.models.loader import load_model


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
