"""Tensor parallelism on CPU processes (gloo): an engine whose model is split over 2 or 3 ranks answers token for token
as the same engine unsplit, with chunked prefill, prefix-cache hits, preemption and concurrent requests, and with
seeded sampling. This process is rank 0; the others are real follower processes (tandem.workers.tp_follower)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.protocol import SamplingParams
from tandem.runtimes.launcher import free_port
from tandem.workers.engine.llm_engine import LLMEngine, load_engine_model
from tandem.workers.tensor_parallel import HeadShard, check_sizes, init_process_group, split, start_followers

SHARED = [5, 9, 13, 200, 7, 7, 31] * 5  # 35 tokens: two full blocks that the later prompts find cached


def prompts() -> list[list[int]]:
    return [SHARED + [40, 41], SHARED + [50, 51, 52, 53], list(range(1000, 1070)), [3, 1, 4, 1, 5, 9, 2, 6]]


def engine_config(model: str, **extra) -> EngineConfig:
    # 10 blocks of 16 tokens hold four prompts of up to 70 tokens and their outputs only if some wait or are
    # preempted; a budget of 24 tokens a step chunks the prefills.
    return EngineConfig(model=model, num_kv_blocks=10, max_num_batched_tokens=24, attention_backend="torch", **extra)


def answers(engine: LLMEngine, params: list[SamplingParams]) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(prompts(), params)]


GREEDY = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 4
SEEDED = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7 + i, ignore_eos=True) for i in range(4)]


@pytest.fixture(scope="module", params=[("tiny_llama_kv4_dir", 2), ("smollm2", 3)], ids=["tiny-llama-tp2", "smollm2-tp3"])
def split_and_whole(request, cpu_kernels):
    """(the engine split over N ranks, the same engine whole, N)."""
    fixture, size = request.param
    model = request.getfixturevalue(fixture) if fixture.endswith("_dir") else fixture
    whole = LLMEngine.from_config(engine_config(model))
    config = engine_config(model, tensor_parallel_size=size)
    port = free_port()
    followers = start_followers(size, port, config.model_dump_json())
    group = init_process_group(0, size, port, torch.device("cpu"))
    try:
        yield LLMEngine(load_engine_model(config, group), config), whole, size
    finally:
        group.broadcast(None)
        for follower in followers:
            follower.wait(30)
        dist.destroy_process_group()


def test_a_split_engine_answers_as_the_whole_one(split_and_whole):
    engine, whole, size = split_and_whole
    model = engine.runner.model
    assert model.tp.size == size and engine.runner.kv_cache.shape[4] == model.num_local_kv_heads
    assert answers(engine, GREEDY) == answers(whole, GREEDY)
    assert engine.block_manager.num_hit_tokens > 0  # the second prompt found the first's blocks
    assert engine.num_preemptions > 0  # 10 blocks: the batch did not fit at once
    assert answers(engine, SEEDED) == answers(whole, SEEDED)


def test_the_tiny_model_split_in_two_answers_as_hf_transformers(split_and_whole, tiny_llama_kv4_dir):
    engine, _, size = split_and_whole
    if size != 2:
        pytest.skip("the HF comparison is the tiny model's")
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_kv4_dir, dtype=torch.float32).eval()
    prompt = prompts()[2]
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], params)[0].token_ids == expected


def test_heads_are_split_evenly_and_kv_heads_replicated_past_their_count():
    assert [HeadShard.of(r, 2, 8, 4) for r in range(2)] == [HeadShard(0, 4, 0, 2), HeadShard(4, 8, 2, 4)]
    # 8 ranks, 4 KV heads: each rank holds the one KV head its query head reads.
    assert [HeadShard.of(r, 8, 8, 4).kv_start for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [HeadShard.of(r, 3, 9, 3) for r in range(3)] == [HeadShard(3 * r, 3 * r + 3, r, r + 1) for r in range(3)]
    assert [split(49153, 2, r) for r in range(2)] == [(0, 24577), (24577, 49153)]


@pytest.mark.parametrize("size, message", [
    (3, "--tensor-parallel-size 3 does not divide the model's 8 attention heads"),
    (0, "--tensor-parallel-size must be >= 1"),
])
def test_a_size_the_model_cannot_be_split_into_is_refused_naming_both_numbers(size, message):
    with pytest.raises(ValueError, match=message):
        check_sizes(size, 8, 4, 128)
    with pytest.raises(ValueError, match="one must divide the other"):
        check_sizes(4, 12, 6, 128)


def test_the_worker_refuses_such_a_size_at_start_in_one_line(tiny_llama_kv4_dir):
    done = subprocess.run([sys.executable, "-m", "tandem.cli", "worker", "--model", tiny_llama_kv4_dir,
                           "--tensor-parallel-size", "3", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, env={"PYTHONSAFEPATH": "1", "PATH": ""})
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1] == "tandem worker: --tensor-parallel-size 3 does not divide the model's 8 attention heads", \
        done.stderr
    assert "Traceback" not in done.stderr


def test_kv_split_over_ranks_is_not_pulled_between_workers_yet():
    """Until tensor-parallel workers pull each rank's share, a decode worker refuses such a handle (and computes the
    prompt itself) rather than read a part of the KV: a wrong answer is never the outcome."""
    from tandem.protocol import LayoutFingerprint

    def layout(tp_size: int) -> LayoutFingerprint:
        return LayoutFingerprint(model="m", dtype="float32", block_size=16, num_layers=2, num_kv_heads=4, head_dim=16,
                                 tp_size=tp_size)

    assert layout(1).mismatches(layout(1)) == []
    assert layout(2).mismatches(layout(1)) == ["tp_size: handle 2, this worker 1"]
    assert "not pulled between workers yet" in layout(2).mismatches(layout(2))[0]


def test_a_worker_whose_follower_dies_exits_whole(tiny_llama_kv4_dir):
    """A tensor-parallel worker serves over HTTP like any other; when a follower rank dies it exits (to be restarted
    whole by its supervisor: Kubernetes, tandem serve), rather than stay up unable to compute a step."""
    import os
    import signal
    import time

    import httpx

    from tandem.runtimes.launcher import ServiceProcess

    worker = ServiceProcess(["worker", "--role", "both", "--model", tiny_llama_kv4_dir, "--tensor-parallel-size", "2",
                             "--num-kv-blocks", "64", "--attention-backend", "torch"], name="tp-worker")
    with worker:
        worker.wait_ready(180)
        body = {"model": os.path.basename(tiny_llama_kv4_dir), "prompt": list(range(1000, 1030)), "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}
        answer = httpx.post(worker.url + "/v1/completions", json=body, timeout=60).json()
        whole = LLMEngine.from_config(EngineConfig(model=tiny_llama_kv4_dir, num_kv_blocks=64,
                                                   attention_backend="torch"))
        expected = whole.generate([body["prompt"]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert answer["choices"][0]["text"] == expected[0].text
        follower = int(subprocess.run(["pgrep", "-P", str(worker.proc.pid), "-f", "tp_follower"],
                                      capture_output=True, text=True).stdout.split()[0])
        os.kill(follower, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while worker.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert worker.proc.returncode not in (None, 0), "the worker stayed up without its rank 1"
        assert "tensor-parallel rank 1 exited" in worker.log_tail()
