"""P/D inside the engine: a prefill engine leases its blocks, a decode engine pulls them (real
NIXL / TCP transfers between two engines in one process), and the tokens equal colocated ones."""

from __future__ import annotations

import contextlib
import random
import re
import threading
import time
from concurrent.futures import Future

import pytest

from tandem.config import EngineConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams, StructuredOutput
from tandem.workers.engine.llm_engine import LLMEngine, RemoteKV
from tandem.workers.kv_transfer import create_kv_transfer, nixl_available
from tandem.workers.models.loader import load_model

BACKENDS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl missing"))]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(tiny_llama_dir, dtype="float32")


def engine(loaded, role: str, **overrides) -> LLMEngine:
    # Pulls in the background, as on a GPU: the CPU's default (the step waits for its pull) is what the worker
    # tests (e2e/test_pd_workers.py) run.
    settings = dict(num_kv_blocks=96, block_size=16, max_num_batched_tokens=64, max_num_seqs=16,
                    kv_pull_in_background="on")
    settings.update(overrides)
    return LLMEngine(loaded, EngineConfig(**settings), EngineMetrics(loaded.config.name, role))


def run(eng: LLMEngine, request_id: str, prompt: list[int], params=GREEDY, **kwargs) -> tuple[list[int], list]:
    eng.add_request(request_id, prompt, params, **kwargs)
    tokens, outputs = [], []
    for _ in range(500):
        for out in eng.step():
            if out.request_id == request_id:
                tokens += out.new_token_ids
                outputs.append(out)
                if out.finished:
                    return tokens, outputs
    raise AssertionError("request did not finish")


def disaggregated(prefill: LLMEngine, decode: LLMEngine, request_id: str, prompt: list[int], params=GREEDY,
                  expires_at: float | None = None) -> tuple[list[int], str]:
    first, outs = run(prefill, request_id, prompt, params, prefill_only=True)
    lease = outs[-1].kv_lease
    assert lease is not None and outs[-1].finished and len(first) == 1
    source = RemoteKV(prefill.kv_transfer.agent_info(), lease.block_ids,
                      lease.expires_at if expires_at is None else expires_at)
    rest, outs = run(decode, request_id, prompt, params, first_token_id=first[0], kv_source=source)
    prefill.release_lease(lease.lease_id)
    return first + rest, outs[0].kv_status


@pytest.fixture(scope="module", params=BACKENDS)
def pd_pair(request, tiny):
    prefill, decode = engine(tiny, "prefill"), engine(tiny, "decode")
    prefill.kv_transfer = create_kv_transfer(request.param, prefill.runner.kv_cache, f"p-{request.param}")
    decode.kv_transfer = create_kv_transfer(request.param, decode.runner.kv_cache, f"d-{request.param}")
    yield prefill, decode
    prefill.kv_transfer.close()
    decode.kv_transfer.close()


@pytest.fixture(scope="module")
def colocated(tiny):
    return engine(tiny, "both")


def prompt_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(length)]


@pytest.mark.parametrize("length", [1, 15, 16, 17, 33, 100, 250])
def test_pd_tokens_equal_colocated_and_decode_computes_no_prompt(pd_pair, colocated, length):
    prefill, decode = pd_pair
    prompt = prompt_of(length, seed=length)
    reference, _ = run(colocated, f"c{length}-{id(prefill)}", prompt)
    computed_before = decode.num_computed_prompt_tokens
    tokens, status = disaggregated(prefill, decode, f"pd{length}", prompt)
    assert status == "pulled"
    assert tokens == reference
    assert decode.num_computed_prompt_tokens == computed_before  # every prompt token came over the wire
    assert prefill.leases.num_pinned_blocks == 0
    assert prefill.num_kv_blocks_used == 0 and decode.num_kv_blocks_used == 0


def test_decode_reuses_its_own_prefix_cache(pd_pair, colocated):
    prefill, decode = pd_pair
    shared = prompt_of(64, seed=7)
    run(decode, "warm", shared + prompt_of(5, seed=8))  # the decode worker now caches 64 tokens of prefix
    prompt = shared + prompt_of(40, seed=9)
    blocks_before = decode.metrics.kv_transfer_blocks._value.get()
    tokens, status = disaggregated(prefill, decode, "reuse", prompt)
    assert status == "pulled"
    pulled = decode.metrics.kv_transfer_blocks._value.get() - blocks_before
    assert pulled == decode.block_manager.blocks_for(len(prompt)) - 4  # the 4 shared blocks stayed local
    assert tokens == run(colocated, "reuse-ref", prompt)[0]


@pytest.mark.parametrize("left_s", [None, 0.1])
def test_expired_lease_falls_back_to_recompute(pd_pair, colocated, left_s):
    """Expired, or within the clock margin of its expiry: the prefill worker may reuse the blocks any moment."""
    prefill, decode = pd_pair
    prompt = prompt_of(50, seed=11)
    expires_at = 0.0 if left_s is None else time.time() + left_s
    tokens, status = disaggregated(prefill, decode, f"expired-{left_s}", prompt, expires_at=expires_at)
    assert status == "lease_expired"
    assert tokens == run(colocated, "expired-ref", prompt)[0]
    assert decode.num_kv_blocks_used == 0


def leased_on_a_clock(tiny, name: str, seed: int):
    """(prefill engine, its lease table's clock [seconds], the lease of a 40-token prompt prefilled on it): a
    5 s TTL that the test moves the clock through."""
    prefill = engine(tiny, "prefill", kv_lease_ttl_s=5.0)
    clock = [1000.0]
    prefill.leases.clock = lambda: clock[0]
    _, outs = run(prefill, name, prompt_of(40, seed=seed), prefill_only=True)
    return prefill, clock, outs[-1].kv_lease


def test_lease_ttl_frees_blocks_and_is_counted(tiny):
    prefill, clock, lease = leased_on_a_clock(tiny, "ttl", seed=3)
    assert prefill.leases.num_pinned_blocks == 3 and prefill.num_kv_blocks_used == 3
    clock[0] += 4.0
    assert prefill.expire_leases() == 0
    clock[0] += 2.0
    assert prefill.expire_leases() == 1
    assert prefill.num_kv_blocks_used == 0 and prefill.leases.num_pinned_blocks == 0
    assert prefill.metrics.kv_lease_expirations._value.get() == 1
    assert not prefill.release_lease(lease.lease_id)  # an expired handle is refused


def test_a_lease_covers_its_own_blocks_while_it_lives(tiny):
    """What the TCP KV server asks before it sends blocks (LeaseTable.covers, wired in workers/main.py)."""
    prefill, clock, lease = leased_on_a_clock(tiny, "covers", seed=4)
    blocks = lease.block_ids
    assert prefill.leases.covers(lease.lease_id, blocks) and prefill.leases.covers(lease.lease_id, blocks[1:])
    assert not prefill.leases.covers(lease.lease_id, [*blocks, max(blocks) + 1])
    assert not prefill.leases.covers("another", blocks)
    clock[0] += 6.0  # past the TTL, not yet expired by a step: no longer good for a read
    assert not prefill.leases.covers(lease.lease_id, blocks)
    clock[0] -= 6.0
    prefill.release_lease(lease.lease_id)
    assert not prefill.leases.covers(lease.lease_id, blocks)


def test_a_release_after_a_read_asked_again_is_answered_as_the_first_time(tiny):
    """A decode worker's release after its read can time out while it waits for a long engine step on the prefill
    worker, which carries it out after the step: the release it sends again must not be told the lease was lost
    (the read was good, and would be thrown away). A lease freed otherwise is still refused to the read's release:
    by the prefill worker itself (its caller left), by the decode worker giving its request up while the read may
    still be on (the blocks may be reused under it), or by expiry."""
    prefill = engine(tiny, "prefill", kv_lease_ttl_s=5.0)
    clock = [1000.0]
    prefill.leases.clock = lambda: clock[0]
    leases = [run(prefill, f"held-{i}", prompt_of(40, seed=10 + i), prefill_only=True)[1][-1].kv_lease
              for i in range(3)]
    assert prefill.release_lease(leases[0].lease_id, after_read=True)
    assert prefill.release_lease(leases[0].lease_id, after_read=True)  # asked again: the same answer
    assert prefill.release_lease(leases[1].lease_id)  # any release but the read's own: not remembered
    assert not prefill.release_lease(leases[1].lease_id, after_read=True)
    clock[0] += 6.0
    assert prefill.expire_leases() == 1
    assert not prefill.release_lease(leases[2].lease_id, after_read=True)
    assert prefill.leases.num_pinned_blocks == 0


def test_failed_pull_falls_back_with_identical_tokens(tiny, colocated):
    prefill, decode = engine(tiny, "prefill"), engine(tiny, "decode")
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, "p-dead")
    decode.kv_transfer = create_kv_transfer("tcp", decode.runner.kv_cache, "d-dead")
    prompt = prompt_of(70, seed=5)
    first, outs = run(prefill, "dead", prompt, prefill_only=True)
    lease = outs[-1].kv_lease
    info = prefill.kv_transfer.agent_info()
    prefill.kv_transfer.close()  # the prefill worker is gone after answering
    rest, outs = run(decode, "dead", prompt, first_token_id=first[0],
                     kv_source=RemoteKV(info, lease.block_ids, lease.expires_at))
    assert outs[0].kv_status == "transfer_failed"
    assert first + rest == run(colocated, "dead-ref", prompt)[0]
    assert decode.num_kv_blocks_used == 0
    assert 'reason="transfer_failed"' in _exposition(decode)
    decode.kv_transfer.close()


def test_prefill_that_finishes_at_its_first_token_leases_nothing(pd_pair):
    prefill, _ = pd_pair
    _, outs = run(prefill, "one", prompt_of(20, seed=1), SamplingParams(temperature=0, max_tokens=1),
                  prefill_only=True)
    assert outs[-1].finish_reason == "length" and outs[-1].kv_lease is None
    assert prefill.num_kv_blocks_used == 0


def _exposition(eng: LLMEngine) -> str:
    from prometheus_client import generate_latest

    return generate_latest(eng.metrics.registry).decode()


@pytest.mark.parametrize("resume_after", [1, 3, 5])
def test_a_resumed_request_loses_no_text_held_back_for_stop_strings(colocated, resume_after):
    """A worker holds back the end of the text in case a stop string begins there. When it fails, the worker
    that resumes replays the output so far (output_tokens_in_prompt), so that end still reaches the client and
    the client's text equals an uninterrupted run's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=["never appears in this text"])
    prompt = prompt_of(20, seed=5)
    tokens, outputs = run(colocated, "whole", prompt, params)
    whole_text = "".join(o.new_text for o in outputs)
    assert len(whole_text) > 0
    sent_text = "".join(o.new_text for o in outputs[:resume_after])  # what the failed worker had released
    assert len(sent_text) < len("".join(colocated.tokenizer.decode(tokens[:resume_after])))  # some was held
    made = tokens[:resume_after]
    rest, outs = run(colocated, f"resumed-{resume_after}", prompt + made[:-1],
                     params.model_copy(update={"max_tokens": params.max_tokens - len(made) + 1}),
                     first_token_id=made[-1], output_tokens_in_prompt=len(made) - 1)
    assert made + rest == tokens
    assert sent_text + "".join(o.new_text for o in outs) == whole_text


def alone_split_resumed(pd_pair, colocated, name: str, prompt: list[int], params: SamplingParams,
                        resume_after: int) -> tuple[list[int], list[int], list[int]]:
    """One request's tokens run on one worker, split over a prefill and a decode worker, and resumed on another
    after `resume_after` tokens (what it had made sent back as prompt, as the router resumes)."""
    prefill, decode = pd_pair
    alone, _ = run(colocated, f"{name}-alone", prompt, params)
    split, _ = disaggregated(prefill, decode, f"{name}-split", prompt, params)
    made = alone[:resume_after]
    rest, _ = run(colocated, f"{name}-resumed", prompt + made[:-1],
                  params.model_copy(update={"max_tokens": params.max_tokens - len(made) + 1}),
                  first_token_id=made[-1], output_tokens_in_prompt=len(made) - 1)
    return alone, split, made + rest


def test_a_seeded_request_samples_the_same_tokens_split_or_resumed(pd_pair, colocated):
    """Each token of a seeded request depends on (seed, position) only: prefilled on one worker and decoded on
    another, or resumed on a third after some tokens, it is what one worker alone samples."""
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    prompt = prompt_of(40, seed=9)
    alone, split, resumed = alone_split_resumed(pd_pair, colocated, "seeded", prompt, params, resume_after=3)
    other_seed, _ = run(colocated, "seeded-other", prompt, params.model_copy(update={"seed": 43}))
    assert split == alone and resumed == alone
    assert other_seed != alone  # the seed is what decides


def test_penalties_count_the_same_output_split_or_resumed(pd_pair, colocated):
    """Penalties count what the request generated: the prefill worker's first token and, on a resume, the output
    that came back as prompt are output on the decode worker too, so every split picks what one worker does."""
    # Negative penalties, so that on this random model (which repeats nothing by itself) they show: repeats favoured.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, frequency_penalty=-2.0,
                            presence_penalty=-1.0, repetition_penalty=0.7)
    prompt = prompt_of(40, seed=10)
    alone, split, resumed = alone_split_resumed(pd_pair, colocated, "penalized", prompt, params, resume_after=4)
    plain, _ = run(colocated, "unpenalized", prompt, params.model_copy(
        update={"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}))
    assert split == alone and resumed == alone
    assert plain != alone  # the penalties changed what greedy picks
    assert len(set(alone)) < len(set(plain))  # toward repeats


def test_min_tokens_counts_the_same_output_split(pd_pair, colocated):
    prefill, decode = pd_pair
    prompt = prompt_of(40, seed=11)
    free, _ = run(colocated, "free", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    stopping = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop_token_ids=[free[1]])
    early, _ = run(colocated, "early", prompt, stopping)
    held = stopping.model_copy(update={"min_tokens": 4})
    alone, _ = run(colocated, "held-alone", prompt, held)
    split, _ = disaggregated(prefill, decode, "held-split", prompt, held)
    assert len(early) <= 2 and len(alone) > 4 and free[1] not in alone[:4]
    assert split == alone  # the decode worker counts the prefill's first token among the four


def test_a_structured_output_holds_split_or_resumed(pd_pair, colocated, tiny):
    """The decode worker's grammar starts where the prefill worker's first token (and, on a resume, the output that
    came back as prompt) left it: every split picks what one worker does, and the output follows the grammar."""
    pattern = "[a-z]{3}-[0-9]{4}"
    params = SamplingParams(temperature=0.0, max_tokens=16, structured=StructuredOutput(kind="regex", value=pattern))
    prompt = prompt_of(40, seed=12)
    alone, split, resumed = alone_split_resumed(pd_pair, colocated, "structured", prompt, params, resume_after=3)
    free, _ = run(colocated, "unstructured", prompt, params.model_copy(update={"structured": None}))
    assert split == alone and resumed == alone
    assert re.fullmatch(pattern, tiny.tokenizer.decode(alone)) and free != alone
    _, outs = run(colocated, "structured-ends", prompt, params)
    assert outs[-1].finish_reason == "stop"  # at the grammar's end, not at max_tokens


class HeldTransfer:
    """The decode engine's real transfer, each read held at its start until `release` is set: a slow link."""

    def __init__(self, inner):
        self.inner, self.started, self.release = inner, threading.Event(), threading.Event()

    def read_blocks(self, *args, **kwargs):
        self.started.set()
        self.release.wait(30)
        return self.inner.read_blocks(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def answered(value: bool) -> Future:
    """RemoteKV.release's future, already answered (the worker's is answered by the prefill worker)."""
    future = Future()
    future.set_result(value)
    return future


def prefilled(prefill: LLMEngine, name: str, prompt: list[int]) -> tuple[int, RemoteKV, str]:
    """(first token, where its KV is, lease id) of a prompt prefilled on `prefill`."""
    first, outs = run(prefill, name, prompt, prefill_only=True)
    lease = outs[-1].kv_lease
    return first[0], RemoteKV(prefill.kv_transfer.agent_info(), lease.block_ids, lease.expires_at), lease.lease_id


def test_running_requests_keep_decoding_while_a_prompts_kv_arrives(pd_pair, colocated):
    """A pull runs beside the steps: the decode worker's running requests do not stall while it lasts."""
    prefill, decode = pd_pair
    prompt = prompt_of(100, seed=13)
    first, source, lease_id = prefilled(prefill, "arriving", prompt)
    real, decode.kv_transfer = decode.kv_transfer, HeldTransfer(decode.kv_transfer)
    try:
        decode.add_request("running", prompt_of(20, seed=14), SamplingParams(temperature=0, max_tokens=30,
                                                                             ignore_eos=True))
        decode.add_request("arriving", prompt, GREEDY, first_token_id=first, kv_source=source)
        while_held = [out for _ in range(10) for out in decode.step()]
        assert decode.kv_transfer.started.is_set()
        assert [out.request_id for out in while_held] == ["running"] * 10
        decode.kv_transfer.release.set()
        tokens, status = [first], None
        while decode.has_unfinished_requests():
            for out in decode.step():
                if out.request_id == "arriving":
                    tokens += out.new_token_ids
                    status = status or out.kv_status
    finally:
        decode.kv_transfer = real
        prefill.release_lease(lease_id)
    assert status == "pulled" and tokens == run(colocated, "arriving-alone", prompt)[0]


def test_a_request_behind_a_prefix_whose_kv_is_on_the_way_computes_it_rather_than_wait(pd_pair, colocated):
    """Blocks a pull is to fill are not announced as being computed: a local request behind the same prefix does
    not wait for the pull, which may be slow or queued behind another's (it waited for the whole held pull)."""
    prefill, decode = pd_pair
    prompt = prompt_of(100, seed=15)
    first, source, lease_id = prefilled(prefill, "pulled", prompt)
    real, decode.kv_transfer = decode.kv_transfer, HeldTransfer(decode.kv_transfer)
    try:
        decode.add_request("pulled", prompt, GREEDY, first_token_id=first, kv_source=source)
        local = prompt[:96] + [7, 8, 9]
        decode.add_request("local", local, GREEDY)
        while_held = [out for _ in range(10) for out in decode.step()]
        assert decode.kv_transfer.started.is_set()
        assert "local" in [out.request_id for out in while_held]
        decode.kv_transfer.release.set()
        tokens = {"pulled": [first], "local": [out_id for out in while_held for out_id in out.new_token_ids]}
        while decode.has_unfinished_requests():
            for out in decode.step():
                tokens[out.request_id] += out.new_token_ids
    finally:
        decode.kv_transfer = real
        prefill.release_lease(lease_id)
    assert tokens["local"] == run(colocated, "local-alone", local)[0]
    assert tokens["pulled"] == run(colocated, "pulled-alone", prompt)[0]
    assert decode.num_kv_blocks_used == 0 and not decode.block_manager._computing


def test_where_steps_wait_for_pulls_a_stuck_pull_holds_them_up_only_so_long(tiny, colocated, monkeypatch):
    """kv_pull_in_background off (a CPU's default): a step waits for the pull, but a pull stuck on a dead peer
    would stall every running request until its timeout. Past the bound the steps go on, the pull beside them."""
    monkeypatch.setattr("tandem.workers.engine.llm_engine._STEP_WAIT_FOR_PULL_S", 0.5)
    prefill, decode = engine(tiny, "prefill"), engine(tiny, "decode", kv_pull_in_background="off")
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, "p-stuck-pull")
    decode.kv_transfer = HeldTransfer(create_kv_transfer("tcp", decode.runner.kv_cache, "d-stuck-pull"))
    try:
        prompt = prompt_of(100, seed=23)
        first, source, lease_id = prefilled(prefill, "arriving", prompt)
        decode.add_request("running", prompt_of(20, seed=24), SamplingParams(temperature=0, max_tokens=30,
                                                                             ignore_eos=True))
        decode.step()  # "running" prefills
        decode.add_request("arriving", prompt, GREEDY, first_token_id=first, kv_source=source)
        started = time.monotonic()
        while_held = [out for _ in range(5) for out in decode.step()]
        assert time.monotonic() - started < 5  # not the 30 s the read is held for
        assert [out.request_id for out in while_held] == ["running"] * 5
        # Another request's pull queues behind the stuck one (one pull at a time): no step waits for it.
        second = prompt_of(60, seed=25)
        first_2, source_2, lease_2 = prefilled(prefill, "queued", second)
        decode.add_request("queued", second, GREEDY, first_token_id=first_2, kv_source=source_2)
        started = time.monotonic()
        assert [out.request_id for _ in range(3) for out in decode.step()] == ["running"] * 3
        assert time.monotonic() - started < 0.4  # under one bounded wait
        decode.kv_transfer.release.set()
        tokens, status = {"arriving": [first], "queued": [first_2]}, {}
        while decode.has_unfinished_requests():
            for out in decode.step():
                if out.request_id in tokens:
                    tokens[out.request_id] += out.new_token_ids
                    status.setdefault(out.request_id, out.kv_status)
        assert status == {"arriving": "pulled", "queued": "pulled"}
        assert tokens["arriving"] == run(colocated, "arriving-alone-2", prompt)[0]
        assert tokens["queued"] == run(colocated, "queued-alone", second)[0]
        prefill.release_lease(lease_id)
        prefill.release_lease(lease_2)
    finally:
        decode.kv_transfer.release.set()
        prefill.kv_transfer.close()
        decode.kv_transfer.close()


def test_a_request_aborted_while_its_kv_arrives_keeps_its_blocks_until_the_read_is_over(pd_pair):
    """The pull thread writes into the request's blocks until its read ends: given to another request before that,
    they would get KV that is not theirs."""
    prefill, decode = pd_pair
    prompt = prompt_of(100, seed=15)
    first, source, lease_id = prefilled(prefill, "aborted", prompt)
    used = decode.num_kv_blocks_used
    real, decode.kv_transfer = decode.kv_transfer, HeldTransfer(decode.kv_transfer)
    try:
        decode.add_request("aborted", prompt, GREEDY, first_token_id=first, kv_source=source)
        decode.step()
        assert decode.kv_transfer.started.wait(10)
        landing = decode.num_kv_blocks_used - used
        assert landing == -(-len(prompt) // 16)
        assert decode.abort_request("aborted")
        assert [(o.request_id, o.finish_reason) for o in decode.step()] == [("aborted", "abort")]
        assert decode.num_kv_blocks_used == used + landing  # still held: the read goes on
        decode.kv_transfer.release.set()
        for _ in range(1000):
            if not decode.has_unfinished_requests():
                break
            decode.step()
    finally:
        decode.kv_transfer = real
        prefill.release_lease(lease_id)
    assert decode.num_kv_blocks_used == used


@pytest.mark.parametrize("background", ["on", "off"])
def test_a_read_whose_lease_was_released_meanwhile_is_not_used(tiny, colocated, background):
    """The router gave up on this decode worker and freed the prefill's blocks while the read was on (they may now
    hold another prompt's KV): the release that follows the read finds the lease gone, so what was read is not
    used (settled as lease_expired, never cached), and the prompt is computed here instead, to the same tokens."""
    prefill = engine(tiny, "prefill", num_kv_blocks=8)  # small: the next prompt takes the freed blocks
    decode = engine(tiny, "decode", kv_pull_in_background=background)
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, f"p-lost-{background}")
    decode.kv_transfer = create_kv_transfer("tcp", decode.runner.kv_cache, f"d-lost-{background}")
    try:
        prompt = prompt_of(64, seed=16)
        first, source, lease_id = prefilled(prefill, "lost", prompt)
        releases = []

        def release() -> Future:  # what the worker's RemoteKV.release does, against an early release by the router
            releases.append(lease_id)
            return answered(prefill.release_lease(lease_id))

        assert prefill.abort_request("lost")  # the router's abort: the lease is gone before the read ends
        run(prefill, "next", prompt_of(100, seed=17))  # and the freed blocks now hold another prompt's KV
        source.release = release
        tokens, outs = run(decode, "lost", prompt, first_token_id=first, kv_source=source)
        assert outs[0].kv_status == "lease_expired" and releases == [lease_id]
        assert [first, *tokens] == run(colocated, "lost-alone", prompt)[0]
        # What the decode worker caches for the prompt is what it computed: a later request hitting it is right.
        later, outs = run(decode, "later", prompt + [7, 8, 9])
        assert outs[-1].num_cached_tokens == 64 and later == run(colocated, "later-alone", prompt + [7, 8, 9])[0]
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()


def test_a_prefill_worker_slow_to_confirm_a_release_holds_up_no_other_pull(tiny, colocated):
    """The lease's release after a read waits for the prefill worker's answer. One that answers late (a worker
    whose event loop is stuck still serves RDMA reads) must hold up only its own request: the pull thread is free
    for the next request's read, which runs and finishes meanwhile."""
    prefill = engine(tiny, "prefill")
    decode = engine(tiny, "decode")
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, "p-slow-release")
    decode.kv_transfer = create_kv_transfer("tcp", decode.runner.kv_cache, "d-slow-release")
    try:
        prompts = {"slow": prompt_of(48, seed=41), "next": prompt_of(48, seed=42)}
        firsts, sources = {}, {}
        for name, prompt in prompts.items():
            firsts[name], sources[name], lease_id = prefilled(prefill, name, prompt)
            sources[name].release = lambda lease_id=lease_id: answered(prefill.release_lease(lease_id, after_read=True))
        late = Future()
        sources["slow"].release = lambda: late  # answered only when the test says
        tokens = {name: [firsts[name]] for name in prompts}
        for name, prompt in prompts.items():
            decode.add_request(name, prompt, GREEDY, first_token_id=firsts[name], kv_source=sources[name])
        finished = set()
        for _ in range(300):
            for out in decode.step():
                tokens[out.request_id] += out.new_token_ids
                finished.update([out.request_id] if out.finished else [])
            if "next" in finished:
                break
        assert finished == {"next"} and tokens["slow"] == [firsts["slow"]]
        late.set_result(True)
        while decode.has_unfinished_requests():
            for out in decode.step():
                tokens[out.request_id] += out.new_token_ids
        for name, prompt in prompts.items():
            assert tokens[name] == run(colocated, f"{name}-slow-release-ref", prompt)[0]
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()


def test_aborting_a_done_prefill_releases_its_lease(pd_pair):
    """A client that leaves after its prefill, before any decode worker got the handle: the router's abort
    frees the pinned blocks now rather than at the lease's expiry."""
    prefill, _ = pd_pair
    run(prefill, "left-after-prefill", prompt_of(40, seed=11), prefill_only=True)
    assert prefill.leases.num_pinned_blocks > 0
    assert prefill.abort_request("left-after-prefill")
    assert prefill.leases.num_pinned_blocks == 0 and len(prefill.leases) == 0
    assert not prefill.abort_request("left-after-prefill")  # once


@contextlib.contextmanager
def over_tcp(prefill: LLMEngine, decode: LLMEngine, tag: str):
    """The two engines' KV transfers (TCP) for one test, closed after it."""
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, f"p-{tag}")
    decode.kv_transfer = create_kv_transfer("tcp", decode.runner.kv_cache, f"d-{tag}")
    try:
        yield
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()


def run_together(prefill: LLMEngine, decode: LLMEngine, params: SamplingParams, imported: dict[str, list[int]],
                 local: dict[str, list[int]] | None = None, steps: int = 300) -> dict[str, list[int]]:
    """Adds the `local` requests (computed on `decode`), then the `imported` ones (prefilled on `prefill`, their KV
    pulled), and steps `decode` until every one has finished, or fails; each one's tokens, an imported one's from
    the prefill's first token on."""
    tokens: dict[str, list[int]] = {}
    for name, prompt in (local or {}).items():
        decode.add_request(name, prompt, params)
        tokens[name] = []
    leases = []
    for name, prompt in imported.items():
        first, source, lease_id = prefilled(prefill, name, prompt)
        tokens[name] = [first]
        leases.append(lease_id)
        decode.add_request(name, prompt, params, first_token_id=first, kv_source=source)
    finished: set[str] = set()
    for _ in range(steps):
        for out in decode.step():
            tokens[out.request_id] += out.new_token_ids
            finished.update([out.request_id] if out.finished else [])
        if finished == set(tokens):
            break
    for lease_id in leases:
        prefill.release_lease(lease_id)
    assert finished == set(tokens), f"never finished: {sorted(set(tokens) - finished)}"
    return tokens


def test_a_request_whose_kv_was_imported_is_not_stuck_behind_one_that_does_not_fit(tiny, colocated):
    """The decode request's pull takes blocks while a request ahead of it waits; that one then no longer fits,
    and only the imported request, once done, can give the blocks back. Both finish, with colocated tokens."""
    prefill = engine(tiny, "prefill")
    decode = engine(tiny, "decode", num_kv_blocks=10, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ahead, imported = prompt_of(126, seed=21), prompt_of(48, seed=22)  # 8 blocks with its output; 3
    with over_tcp(prefill, decode, "stuck"):
        tokens = run_together(prefill, decode, params, {"imported": imported}, local={"ahead": ahead}, steps=200)
    assert tokens["ahead"] == run(colocated, "ahead-ref", ahead, params)[0]
    assert tokens["imported"] == run(colocated, "imported-ref", imported, params)[0]
    assert decode.num_kv_blocks_used == 0


@pytest.mark.parametrize("background", ["on", "off"])
def test_pulled_prompts_that_fill_the_cache_still_finish(tiny, colocated, background):
    """Two prompts of exactly two blocks each pulled into a four-block cache: each pull must keep room for the
    first token's slot (a fifth block would be needed otherwise), or both wait for a block forever with the
    cache full of their prompts and nothing running. Found by a randomized engine fuzzer."""
    prefill = engine(tiny, "prefill")
    decode = engine(tiny, "decode", num_kv_blocks=4, block_size=16, kv_pull_in_background=background)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = {"a": prompt_of(32, seed=31), "b": prompt_of(32, seed=32)}
    with over_tcp(prefill, decode, f"full-{background}"):
        tokens = run_together(prefill, decode, params, prompts)
    for name, prompt in prompts.items():
        assert tokens[name] == run(colocated, f"{name}-full-ref-{background}", prompt, params)[0]
    assert decode.num_kv_blocks_used == 0


def test_a_request_whose_kv_was_imported_is_not_stuck_behind_one_that_fits_only_in_part(tiny, colocated):
    """A local request ahead in the queue fits one chunk at a time: it takes the step's budget, finds no room for
    its next chunk (the imported prompts hold the blocks), gives way and comes back, step after step, unless the
    requests that hold their blocks go first. Found by a randomized engine fuzzer."""
    prefill = engine(tiny, "prefill")
    # No prefix caching: with it, the chunk computed before giving way is found again, and the request ahead
    # no longer fits at its return, a case the scheduler already let the others pass.
    decode = engine(tiny, "decode", num_kv_blocks=10, max_num_batched_tokens=32, max_num_seqs=2,
                    kv_pull_in_background="off", enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ahead = prompt_of(60, seed=51)  # 4 blocks with its output, 2 per 32-token chunk
    imported = {"imported-1": prompt_of(48, seed=52), "imported-2": prompt_of(48, seed=53)}  # 4 blocks each
    with over_tcp(prefill, decode, "part"):
        tokens = run_together(prefill, decode, params, imported, local={"ahead": ahead}, steps=200)
    for name, prompt in {"ahead": ahead, **imported}.items():
        assert tokens[name] == run(colocated, f"{name}-part-ref", prompt, params)[0]
    assert decode.num_kv_blocks_used == 0


def test_cached_tokens_are_the_first_admissions_after_a_preemption(tiny):
    """A preempted request comes back with its output, and finds the blocks it computed itself in the prefix cache:
    those hits are no prompt tokens served from the cache (usage.prompt_tokens_details.cached_tokens). Prompts
    never seen before report none, however often they were preempted, as vLLM counts."""
    eng = engine(tiny, "both", num_kv_blocks=5, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng.add_request("a", prompt_of(20, seed=31), params)
    eng.add_request("b", prompt_of(20, seed=32), params)
    reported = set()
    for _ in range(500):
        for out in eng.step():
            reported.add(out.num_cached_tokens)
        if not eng.has_unfinished_requests():
            break
    assert eng.num_preemptions > 0
    assert reported == {0}


class SlowReads:
    """A KV transfer whose reads take `seconds` longer: a slow network."""

    def __init__(self, transfer, seconds: float):
        self.transfer, self.seconds = transfer, seconds

    def read_blocks(self, *args, **kwargs):
        moved = self.transfer.read_blocks(*args, **kwargs)
        time.sleep(self.seconds)
        return moved

    def __getattr__(self, name):
        return getattr(self.transfer, name)


def test_a_lease_that_runs_out_during_the_pull_is_not_trusted(pd_pair, colocated):
    """The read began with the lease alive but ended after it: the prefill worker may have reused the blocks
    under it. The pulled KV is dropped and the prompt computed, so the tokens are still colocated's."""
    prefill, decode = pd_pair
    prompt = prompt_of(60, seed=41)
    fast = decode.kv_transfer
    decode.kv_transfer = SlowReads(fast, seconds=0.6)
    try:
        tokens, status = disaggregated(prefill, decode, "slow-pull", prompt, expires_at=time.time() + 0.7)
    finally:
        decode.kv_transfer = fast
    assert status == "lease_expired"
    assert tokens == run(colocated, "slow-pull-ref", prompt)[0]
    assert decode.num_kv_blocks_used == 0


def test_requests_with_different_grammars_and_none_share_a_batch(colocated, tiny):
    """Rows with grammars and rows without, in one batch: each follows its own grammar (the masks go to the right
    rows), and the free ones pick what they pick alone."""
    patterns = ["[a-z]{4}", "[0-9]{2}-[0-9]{2}", "(yes|no)", "x+y"]
    prompts = [prompt_of(30 + i, seed=20 + i) for i in range(6)]
    params = [SamplingParams(temperature=0.0, max_tokens=10, structured=StructuredOutput(kind="regex", value=p))
              for p in patterns] + [GREEDY, GREEDY]
    alone = [run(colocated, f"alone-{i}", prompt, p)[0] for i, (prompt, p) in enumerate(zip(prompts, params))]
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        colocated.add_request(f"together-{i}", prompt, p)
    together = {f"together-{i}": [] for i in range(6)}
    while colocated.has_unfinished_requests():
        for out in colocated.step():
            together[out.request_id] += out.new_token_ids
    for i, pattern in enumerate(patterns):
        assert re.fullmatch(pattern, tiny.tokenizer.decode(together[f"together-{i}"])), (pattern, together)
    assert [together[f"together-{i}"] for i in range(6)] == alone


class ReadsLate(SlowReads):
    """A KV transfer whose reads begin `seconds` late: the blocks can change hands before they are read."""

    def read_blocks(self, *args, **kwargs):
        time.sleep(self.seconds)
        return self.transfer.read_blocks(*args, **kwargs)


def test_a_read_whose_lease_its_own_worker_gave_up_meanwhile_is_not_used(tiny, colocated):
    """The decode request is given up while its pull is on (its client left): the decode worker releases the lease
    then (decode_events), and the prefill worker reuses the blocks for another prompt before the read. The pull's
    own release after the read must be told the lease was gone, and what was read never used nor cached: a
    release that is not the read's is not remembered as one (LeaseTable.release)."""
    prefill = engine(tiny, "prefill", num_kv_blocks=6)
    decode = engine(tiny, "decode", kv_pull_in_background="off")
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, "p-gave-up")
    decode.kv_transfer = ReadsLate(create_kv_transfer("tcp", decode.runner.kv_cache, "d-gave-up"), 0.5)
    try:
        prompt, other = prompt_of(48, seed=1), prompt_of(80, seed=2)
        first, outs = run(prefill, "a", prompt, prefill_only=True)
        lease = outs[-1].kv_lease
        told = []

        def release_after_read() -> Future:  # RemoteKV.release, as the worker sends it
            told.append(prefill.release_lease(lease.lease_id, after_read=True))
            return answered(told[-1])

        decode.add_request("a", prompt, GREEDY, first_token_id=first[0], kv_source=RemoteKV(
            prefill.kv_transfer.agent_info(), lease.block_ids, lease.expires_at, release=release_after_read))

        def given_up_meanwhile():
            time.sleep(0.1)
            prefill.release_lease(lease.lease_id)  # decode_events' release, its request cancelled mid-pull
            run(prefill, "b", other, prefill_only=True)  # the freed blocks hold another prompt's KV now

        thread = threading.Thread(target=given_up_meanwhile)
        thread.start()
        decode.step()  # waits for the pull (up to 1 s), which reads the reused blocks
        thread.join()
        assert told == [False]
        decode.abort_request("a")
        decode.step()
        again, _ = run(decode, "a-again", prompt)  # nothing of the bad read is in its prefix cache
        assert again == run(colocated, "a-ref", prompt)[0]
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()


def test_pd_tokens_equal_colocated_for_a_mixture_of_experts_model(tiny_qwen2_moe_dir):
    """Qwen2-MoE (routed and shared experts, one dense layer): the KV a prefill worker computes decodes elsewhere
    into the tokens one engine gives."""
    moe = load_model(tiny_qwen2_moe_dir, dtype="float32")
    prefill, decode, colocated = engine(moe, "prefill"), engine(moe, "decode"), engine(moe, "both")
    prefill.kv_transfer = create_kv_transfer("tcp", prefill.runner.kv_cache, "p-moe")
    decode.kv_transfer = create_kv_transfer("tcp", decode.runner.kv_cache, "d-moe")
    try:
        for length in (17, 100):
            reference, _ = run(colocated, f"moe-c{length}", prompt_of(length, seed=length))
            tokens, status = disaggregated(prefill, decode, f"moe-pd{length}", prompt_of(length, seed=length))
            assert status == "pulled" and tokens == reference
    finally:
        prefill.kv_transfer.close()
        decode.kv_transfer.close()
