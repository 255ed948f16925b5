"""The engine's start-up calibration: it fits a step cost model, leaves the engine as it found it, and is measured
once per machine and configuration."""

import json

import pytest

from tandem.config import EngineConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams
from tandem.workers.engine import calibration
from tandem.workers.engine.calibration import calibrate
from tandem.workers.engine.llm_engine import LLMEngine


def engine_for(model_dir: str) -> LLMEngine:
    config = EngineConfig(model=model_dir, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=128)
    engine = LLMEngine.from_config(config)
    engine.metrics = EngineMetrics(engine.model_name, "both")
    return engine


@pytest.fixture(autouse=True)
def cores_of_its_own(monkeypatch):
    """Every pass counts as having had its cores (a shared test host's load must not decide what is cached); the
    tests of a busy host say otherwise themselves."""
    monkeypatch.setattr(calibration, "cpu_share", lambda cpu_s, wall_s, threads: 1.0)


PROMPTS = [[5, 9, 13, 200, 7, 7, 31] * 5, [1000 + i for i in range(40)]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def test_calibration_fits_a_model_and_leaves_no_trace(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    reference = [r.token_ids for r in engine_for(tiny_llama_dir).generate(PROMPTS, GREEDY)]

    engine = engine_for(tiny_llama_dir)
    cost = calibrate(engine)
    assert cost is not None and cost == engine.step_costs.cost()
    assert cost.prefill_s(128) > cost.prefill_s(16) > 0
    # Nothing it ran counts: the engine's counters, its metrics and its KV blocks are a new engine's.
    assert (engine.num_prompt_tokens, engine.num_generation_tokens, engine.num_prefix_queried_tokens) == (0, 0, 0)
    assert sum(engine.num_finished.values()) == 0
    assert engine.metrics.prompt_tokens._value.get() == 0
    pool = engine.block_manager.pool
    assert pool.free_block_ids() == list(range(64)) and pool.num_cached == 0
    # And it serves as an engine that was never calibrated does.
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == reference
    assert engine.num_prompt_tokens == sum(map(len, PROMPTS))


def test_a_second_engine_of_the_same_configuration_reads_the_measurements(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    first = calibrate(engine_for(tiny_llama_dir))
    assert len(list(tmp_path.glob("step-cost-*.json"))) == 1

    def measured_again(engine):
        raise AssertionError("calibrated again instead of reading the cache")

    monkeypatch.setattr(calibration, "measure", measured_again)
    assert calibrate(engine_for(tiny_llama_dir)) == first
    # Another configuration (a different step budget) is measured for itself.
    other = LLMEngine.from_config(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, max_num_batched_tokens=64))
    with pytest.raises(AssertionError, match="calibrated again"):
        calibrate(other)


def test_a_damaged_cache_file_is_measured_again(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    engine = engine_for(tiny_llama_dir)
    (tmp_path / f"step-cost-{calibration.cache_key(engine)}.json").write_text('{"samples": [[1, 2]]}')
    assert calibrate(engine) is not None
    assert len(calibration._read(str(tmp_path / f"step-cost-{calibration.cache_key(engine)}.json"))) > 4


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_calibration_on_a_gpu_engine_with_its_graphs(tiny_llama_dir, tmp_path, monkeypatch):
    """On a GPU the decode steps replay CUDA graphs and the sampled tokens are read back each step: the timed
    steps are the device's, and the engine still serves as before."""
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    config = EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=128,
                          device="cuda", dtype="float32")
    reference = [r.token_ids for r in LLMEngine.from_config(config).generate(PROMPTS, GREEDY)]
    engine = LLMEngine.from_config(config)
    cost = calibrate(engine)
    assert cost.prefill_s(128) >= cost.prefill_s(16) > 0
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == reference


def test_a_cache_folder_that_cannot_be_written_only_costs_the_measuring(tiny_llama_dir, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(calibration.CACHE_ENV, str(blocked / "cache"))  # under a file: no folder can be made there
    assert calibrate(engine_for(tiny_llama_dir)) is not None


def decode_steps(*seconds: float, batch: int = 1) -> list[list[float]]:
    return [[batch, batch, batch * (33 + i), s] for i, s in enumerate(seconds)]


def test_a_busy_host_is_measured_again_and_its_figures_not_kept(tiny_llama_dir, tmp_path, monkeypatch):
    """Steps slowed by other processes would be a pessimistic prior kept for good (every request refused as
    unmeetable): measured again, each step's fastest pass kept, and cached only once steady."""
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    prefill = [[16, 1, 136, 0.03]]
    busy, quiet = prefill + decode_steps(0.01, 0.5, 0.6, 0.5), prefill + decode_steps(0.5, 0.011, 0.01, 0.012)
    assert calibration.spread(busy) > calibration.STEADY_SPREAD >= calibration.spread(quiet)
    passes = iter([busy, quiet])
    monkeypatch.setattr(calibration, "measure", lambda engine: next(passes))
    calibrate(engine_for(tiny_llama_dir))
    kept = json.loads(next(tmp_path.glob("step-cost-*.json")).read_text())["samples"]
    assert kept == prefill + decode_steps(0.01, 0.011, 0.01, 0.012)  # step by step, the faster pass

    for path in tmp_path.glob("step-cost-*"):
        path.unlink()
    monkeypatch.setattr(calibration, "measure", lambda engine: busy)  # busy every time: used, not kept
    assert calibrate(engine_for(tiny_llama_dir)) is not None
    assert not list(tmp_path.glob("step-cost-*.json"))


def test_a_pass_that_did_not_get_its_cores_is_not_kept(tiny_llama_dir, tmp_path, monkeypatch):
    """Steps slowed all alike (another process on the cores the whole time) look steady; the CPU time the process
    got says otherwise: the figures are used for this start, not cached for the next."""
    monkeypatch.setenv(calibration.CACHE_ENV, str(tmp_path))
    steps = [[16, 1, 136, 0.03], *decode_steps(0.01, 0.011, 0.01, 0.012)]
    monkeypatch.setattr(calibration, "measure", lambda engine: steps)
    monkeypatch.setattr(calibration, "cpu_share", lambda cpu_s, wall_s, threads: 0.3)
    assert calibrate(engine_for(tiny_llama_dir)) is not None
    assert not list(tmp_path.glob("step-cost-*.json"))
    monkeypatch.setattr(calibration, "cpu_share", lambda cpu_s, wall_s, threads: 0.95)
    calibrate(engine_for(tiny_llama_dir))
    assert list(tmp_path.glob("step-cost-*.json"))


def test_the_workload_decodes_at_a_long_context_too(tiny_llama_dir):
    """Without decode steps at more than the short prompts' context, the decode model's attention-pair term was a guess
    (far above what a pair costs): long streams were refused as too slow for their ITL."""
    engine = LLMEngine.from_config(EngineConfig(model=tiny_llama_dir, num_kv_blocks=64, max_num_seqs=8,
                                                max_num_batched_tokens=1024))
    samples = calibration.measure(engine)  # prefills of 16, 128 and 512 tokens; the last decodes on
    contexts = {pairs // sequences for tokens, sequences, pairs, _ in samples if tokens == sequences}
    assert max(contexts) >= 8 * min(contexts), contexts
