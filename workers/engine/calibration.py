"""The engine's start-up calibration: steps of known work, timed, as the prior of its step cost model.

A worker runs it once before it is ready, so that routers can predict its latencies from the first request
(tandem.step_cost; docs/admission.md). The steps' measurements are kept in a cache folder, keyed by what decides
them (model file, device, dtype, kernels, threads, step budget): a worker started again on the same machine reads
them instead of measuring again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import random
import statistics
import time
from collections.abc import Iterator

import torch

from tandem.model_source import resolve_model_source
from tandem.protocol import SamplingParams
from tandem.step_cost import StepCost

log = logging.getLogger(__name__)

CACHE_ENV = "TANDEM_CACHE_DIR"
DECODE_STEPS = 4  # decode steps timed per batch size
DECODE_PROMPT_TOKENS = 32
# spread() at most this: a quiet host's is near 1, one whose cores other processes took is several times that.
# Beyond it the workload is measured again, MAX_PASSES times at most.
STEADY_SPREAD = 2.5
MAX_PASSES = 2
# A CPU worker's calibration that got under this share of its threads' time ran beside other work: a quiet host
# gives it nearly all of it, while another process on the cores slows every step alike, which spread() does not show.
MIN_CPU_SHARE = 0.5
SPIKE_LIMIT = 2.0  # a decode step counts at most this many times the median of its run's steps


class _Recorder:
    """Stands in for the engine's StepCostFit while calibrating: keeps each step's measurement."""

    def __init__(self):
        self.samples: list[list[float]] = []

    def add(self, tokens: float, sequences: float, pairs: float, seconds: float) -> None:
        self.samples.append([tokens, sequences, pairs, seconds])

    def cost(self) -> None:
        """No model while calibrating: the engine measures no gaps against one (LLMEngine._time_gap)."""
        return None


def calibrate(engine) -> StepCost:
    """Time the calibration steps (or read them from the cache) into `engine.step_costs` as its prior; returns the
    model they give."""
    path = os.path.join(cache_dir(), f"step-cost-{cache_key(engine)}.json")
    with contextlib.ExitStack() as held:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            held.enter_context(_locked(path + ".lock"))  # workers started together measure one after the other
        except OSError as exc:  # the cache only saves time: without it, this worker measures
            log.warning("step cost calibration: cannot use the cache folder %s (%s)", os.path.dirname(path), exc)
            path = None
        samples = _read(path) if path else None
        if samples is None:
            started = time.monotonic()
            samples, steady = measure_steadily(engine)
            log.info("step cost calibration: %d steps in %.1f s", len(samples), time.monotonic() - started)
            if not steady:
                log.warning("step cost calibration: the host was busy (other work on its cores); the figures are used "
                            "but not kept: the next start measures again")
            elif path:
                _write(path, samples)
    for tokens, sequences, pairs, seconds in without_spikes(samples):
        engine.step_costs.add(tokens, sequences, pairs, seconds, prior=True)
    return engine.step_costs.cost()


def without_spikes(samples: list[list[float]]) -> list[list[float]]:
    """The samples with each decode step held to SPIKE_LIMIT x the median of its run's steps: one step that
    another process delayed (several times as long as its run's others) would otherwise weigh in the fit as if the
    worker were that slow, and admission refuse streams it can serve."""
    medians = {run: statistics.median(t) for run, t in _decode_times(samples).items()}
    return [[tokens, sequences, pairs, min(seconds, SPIKE_LIMIT * medians[_run(sequences, pairs)])
             if tokens == sequences else seconds] for tokens, sequences, pairs, seconds in samples]


def _run(sequences: float, pairs: float) -> tuple[float, int]:
    """Which run of decode steps a step belongs to: its batch size and its context (in 64-token bands)."""
    return sequences, int(pairs / sequences) // 64


def _decode_times(samples: list[list[float]]) -> dict[tuple[float, int], list[float]]:
    """The decode steps' seconds by run (a decode step computes one token per sequence)."""
    runs: dict[tuple[float, int], list[float]] = {}
    for tokens, sequences, pairs, seconds in samples:
        if tokens == sequences:
            runs.setdefault(_run(sequences, pairs), []).append(seconds)
    return runs


def measure_steadily(engine) -> tuple[list[list[float]], bool]:
    """measure(), repeated while its steps are unsteady (MAX_PASSES at most): each step's time is its fastest pass.
    Returns the samples and whether they are steady: spread() within STEADY_SPREAD, and on a CPU the last pass had
    its cores (cpu_share)."""
    samples, share = timed_measure(engine)
    for _ in range(MAX_PASSES - 1):
        # Only spikes are measured again: a host busy all along (a low CPU share) would most likely stay busy, and
        # each pass there takes several times as long; its figures are only not kept.
        if spread(samples) <= STEADY_SPREAD:
            break
        again, share = timed_measure(engine)
        if [s[:3] for s in again] != [s[:3] for s in samples]:  # another schedule: not comparable step by step
            break
        samples = [[*s[:3], min(s[3], a[3])] for s, a in zip(samples, again, strict=True)]
    return samples, share >= MIN_CPU_SHARE and spread(samples) <= STEADY_SPREAD


def timed_measure(engine) -> tuple[list[list[float]], float]:
    """measure(), and the share of its threads' time the process got on a CPU worker (1.0 on a GPU, whose steps the
    process waits for)."""
    wall, cpu = time.perf_counter(), time.process_time()
    samples = measure(engine)
    if engine.runner.device.type != "cpu":
        return samples, 1.0
    return samples, cpu_share(time.process_time() - cpu, time.perf_counter() - wall, torch.get_num_threads())


def cpu_share(cpu_s: float, wall_s: float, threads: int) -> float:
    """CPU time got over CPU time its threads could have had."""
    return cpu_s / max(wall_s * threads, 1e-9)


def spread(samples: list[list[float]]) -> float:
    """How unsteady the calibration's repeated decode steps are (the same batch on a token more each): the largest,
    over runs (a batch size at one context), of the median step's time over the fastest's. Near 1 on a quiet host;
    spikes from other processes raise it."""
    return max((statistics.median(t) / max(min(t), 1e-9) for t in _decode_times(samples).values() if len(t) > 1),
               default=1.0)


def measure(engine) -> list[list[float]]:
    """Runs the calibration workload through the engine and returns its steps' [tokens, sequences sampled, attention
    pairs, seconds]. Leaves no trace: the engine's counters and KV blocks are as before."""
    config = engine.config
    budget, limit = config.max_num_batched_tokens, engine.max_model_len - 1
    prefills = sorted({max(1, min(n, limit)) for n in (16, budget // 8, budget // 2)})
    batches = sorted({max(1, n) for n in (1, config.max_num_seqs // 4, config.max_num_seqs // 2)})
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    recorder = _Recorder()
    with _unrecorded(engine):
        fit, engine.step_costs = engine.step_costs, recorder
        try:
            engine.generate([prompt(16)], _greedy(2))  # first-use costs (lazy initialisation, kernel builds)
            if engine.runner.device.type == "cuda":  # and each prefill's shape once: its kernels and GEMM plans
                for n in prefills:
                    engine.generate([prompt(n)], _greedy(1))
            recorder.samples.clear()  # are not the steps' own
            for n in prefills[:-1]:
                engine.generate([prompt(n)], _greedy(1))
            # The longest prompt also decodes a few steps: a batch of one at a long context, without which the decode
            # model's attention-pair term is not told apart from its per-sequence term (every other decode step sees
            # about DECODE_PROMPT_TOKENS of context) and a long stream's steps were predicted far too slow.
            longest = max(1, min(prefills[-1], limit - DECODE_STEPS))
            engine.generate([prompt(longest)], _greedy(DECODE_STEPS + 1))
            decode_len = min(DECODE_PROMPT_TOKENS, max(1, limit - DECODE_STEPS - 1))
            for batch in batches:
                engine.generate([prompt(decode_len) for _ in range(batch)], _greedy(DECODE_STEPS + 1))
        finally:
            engine.step_costs = fit
    return recorder.samples


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@contextlib.contextmanager
def _unrecorded(engine) -> Iterator[None]:
    """Runs requests through the engine without them counting: metrics detached, cumulative counters restored and
    the KV blocks as a new engine's (free, in order, nothing cached)."""
    bm, scheduler = engine.block_manager, engine.scheduler
    saved = (engine.metrics, engine.num_prompt_tokens, engine.num_computed_prompt_tokens,
             engine.num_generation_tokens, dict(engine.num_finished), bm.num_queried_tokens, bm.num_hit_tokens,
             scheduler.num_preemptions)
    engine.metrics = None
    try:
        yield
    finally:
        (engine.metrics, engine.num_prompt_tokens, engine.num_computed_prompt_tokens, engine.num_generation_tokens,
         engine.num_finished, bm.num_queried_tokens, bm.num_hit_tokens, scheduler.num_preemptions) = saved
        bm.pool.reset()


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")


def cache_key(engine) -> str:
    """What the calibration's timings depend on, hashed: the model file (path, size, time), the device, dtype and
    kernels, the host's processor and threads, and the engine's step limits."""
    config, runner = engine.config, engine.runner
    try:
        source = resolve_model_source(config.model)
        stat = os.stat(source)
        model = [os.path.abspath(source), stat.st_size, stat.st_mtime_ns]
    except (OSError, ValueError):
        model = [config.model]
    device = runner.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    parts = [model, device.type, device_name, str(runner.dtype), runner.model.ops.backend, torch.__version__,
             torch.get_num_threads(), config.block_size, config.max_num_batched_tokens, config.max_num_seqs,
             engine.max_model_len, config.quantized_gemv, config.enforce_eager, 2]  # the last: this workload's version
    if runner.kv_cache.dtype != runner.dtype:  # an FP8 KV cache (keys of float caches unchanged)
        parts.append(str(runner.kv_cache.dtype))
    return hashlib.blake2b(json.dumps(parts).encode(), digest_size=8).hexdigest()


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _read(path: str) -> list[list[float]] | None:
    try:
        with open(path) as f:
            samples = json.load(f)["samples"]
        if samples and all(isinstance(s, list) and len(s) == 4 for s in samples):
            return samples
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write(path: str, samples: list[list[float]]) -> None:
    """Written whole or not at all (a file renamed into place), so that a reader never sees half of it."""
    with contextlib.suppress(OSError):
        partial = f"{path}.{os.getpid()}.tmp"
        with open(partial, "w") as f:
            json.dump({"samples": samples}, f)
        os.replace(partial, path)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    with open(path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
