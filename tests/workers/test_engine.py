"""LLMEngine end to end on real weights: greedy tokens identical to HF transformers `generate`.

Covers single requests, many concurrent requests of mixed lengths (continuous batching), a
prompt longer than the step budget (chunked prefill), a shared long prefix (prefix-cache hit),
a KV cache small enough to force preemption, abort, stop conditions, validation and metrics.
Models: the real SmolLM2-135M GGUF (float32) and tiny random checkpoints of the other families, on the ops a CPU
worker serves with ("auto": the native paged-attention kernel where it builds; for the SmolLM2 GGUF, decode
GEMMs from its blocks where the GGUF GEMV runs).
HF references are computed once per (model, prompt, length) for the whole session.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from tandem.config import EngineConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.engine.model_runner import ModelRunner, kv_block_bytes
from tandem.workers.engine.sequence import Sequence
from tandem.workers.layers.ops import resolve_backend
from tandem.workers.models.config import ModelConfig
from tandem.workers.models.loader import load_model

TEXT = (
    "The history of the lighthouse begins with fires lit on hilltops to guide ships at night. "
    "Over the centuries these simple beacons became towers of stone, and the open flames gave way to "
    "oil lamps, then to clockwork lenses that turned to throw a beam across the water. Keepers lived "
    "in small cottages at the foot of each tower, trimming wicks, polishing brass and writing the "
    "weather into thick logbooks every few hours. Storms could cut a station off for weeks, so a keeper "
    "learned to bake bread, mend nets, read the sky and keep a garden in salty soil. When electricity "
    "arrived, the lamps grew brighter and the work grew lighter; later still, automatic timers and radio "
    "beacons replaced the keepers altogether. Today many of the old towers are museums, where visitors "
    "climb the spiral stairs to look out over the sea and imagine the long nights of the people who once "
    "kept the light burning. Engineers still study their designs, because a tower that has stood against "
    "two hundred winters has a great deal to teach about wind, water and stone."
)

# (offset, length, max_tokens): slices of TEXT's tokens, so lengths mix short and long.
MIXED = [(0, 5, 12), (3, 60, 8), (10, 17, 16), (40, 120, 10), (7, 2, 14), (25, 33, 9), (60, 90, 12),
         (80, 11, 16), (12, 140, 8), (90, 24, 11)]
MODELS = ["smollm2", "tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mixtral", "tiny_qwen2_moe", "tiny_qwen3_moe",
          "tiny_phi3", "tiny_gemma2", "tiny_gemma3"]


class ModelUnderTest:
    def __init__(self, name, loaded, hf_model):
        self.name = name
        self.loaded = loaded
        self.hf = hf_model
        self._reference: dict[tuple, list[int]] = {}
        self.text_ids = loaded.tokenizer.encode(TEXT, add_special_tokens=False)

    def hf_greedy(self, prompt: list[int], max_tokens: int) -> list[int]:
        """HF `generate`, greedy, not stopping at EOS (the engine runs with ignore_eos to match)."""
        key = (tuple(prompt), max_tokens)
        if key not in self._reference:
            config = copy.deepcopy(self.hf.generation_config)
            config.eos_token_id = None
            config.do_sample = False
            config.temperature, config.top_p, config.top_k = None, None, None
            input_ids = torch.tensor([prompt])
            with torch.inference_mode():
                out = self.hf.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                                       max_new_tokens=max_tokens, pad_token_id=0)
            self._reference[key] = out[0, len(prompt):].tolist()
        return self._reference[key]

    def mixed_prompts(self) -> list[tuple[list[int], int]]:
        return [(self.text_ids[off:off + n], max_tokens) for off, n, max_tokens in MIXED]


@pytest.fixture(scope="session")
def models_under_test():
    return {}


@pytest.fixture(scope="session", params=MODELS)
def mut(request, models_under_test) -> ModelUnderTest:
    name = request.param
    if name not in models_under_test:
        transformers = pytest.importorskip("transformers")
        if name == "smollm2":
            loaded = request.getfixturevalue("smollm2")  # already on the serving backend
            hf_model, _ = request.getfixturevalue("hf_smollm2")
        else:
            folder = request.getfixturevalue(f"{name}_dir")
            loaded = load_model(folder, dtype="float32", backend=resolve_backend("auto", "cpu"))
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        models_under_test[name] = ModelUnderTest(name, loaded, hf_model)
    return models_under_test[name]


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir):
    return load_model(tiny_llama_dir, dtype="float32")


def make_engine(loaded, **overrides) -> LLMEngine:
    settings = dict(num_kv_blocks=512, max_num_batched_tokens=256, max_num_seqs=16)
    settings.update(overrides)
    return LLMEngine(loaded, EngineConfig(**settings), EngineMetrics(loaded.config.name, "both"))


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> tuple[dict, list[list]]:
    """Submit everything at once and step to completion: ({id: token ids}, outputs of every step)."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"req-{i}", prompt, params)
    tokens = {f"req-{i}": [] for i in range(len(requests))}
    steps = []
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        outs = engine.step()
        steps.append(outs)
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
    else:
        pytest.fail("engine did not finish")
    return tokens, steps


def metric(engine: LLMEngine, name: str, **labels) -> float:
    value = engine.metrics.registry.get_sample_value(name, {**engine.metrics.labels, **labels})
    return 0.0 if value is None else value


# ------------------------------------------------------------------ model runner (no weights needed)


def fake_loaded(num_layers=2, num_kv_heads=2, head_dim=8):
    config = ModelConfig(architecture="llama", vocab_size=100, hidden_size=16, intermediate_size=32,
                         num_layers=num_layers, num_heads=2, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256)
    return types.SimpleNamespace(model=None, config=config, tokenizer=None, dtype=torch.float32,
                                 device=torch.device("cpu"))


def test_runner_sizes_the_kv_cache():
    runner = ModelRunner(fake_loaded(), EngineConfig(num_kv_blocks=7, block_size=4))
    assert tuple(runner.kv_cache.shape) == (7, 2, 2, 4, 2, 8)
    per_block = kv_block_bytes(2, 16, 2, 8, torch.float32)
    assert per_block == 2 * 2 * 16 * 2 * 8 * 4
    by_memory = ModelRunner(fake_loaded(), EngineConfig(kv_cache_memory_gb=per_block * 10 / (1 << 30)))
    assert by_memory.num_blocks == 10


def test_runner_flattens_a_mixed_batch():
    runner = ModelRunner(fake_loaded(), EngineConfig(num_kv_blocks=16, block_size=4))
    decode = Sequence("decode", [1, 2, 3, 4, 5], SamplingParams())
    decode.append_token(6)
    decode.num_computed_tokens, decode.block_table = 5, [9, 3]
    # 10 tokens, 3 computed, 5 more now; prompt logprobs wanted: positions 3-7 each predict a prompt token.
    chunk = Sequence("chunk", list(range(10, 20)), SamplingParams(prompt_logprobs=1))
    chunk.num_computed_tokens, chunk.block_table = 3, [7, 2]
    # Whole prompt in one go; of its positions 0-2 only 0 and 1 predict a prompt token (2 predicts the output).
    last = Sequence("last", [30, 31, 32], SamplingParams(prompt_logprobs=0))
    last.block_table = [5]
    step, rows, prompt_rows = runner.prepare([decode, chunk, last], [1, 5, 3])
    assert step.prompt_spans == [(1, 5), (6, 2)] and prompt_rows == [(1, 3), (2, 0)]
    input_ids, positions, meta = runner.tensors(step)
    logits_indices = step.logits_indices
    assert input_ids.tolist() == [6, 13, 14, 15, 16, 17, 30, 31, 32]
    assert positions.tolist() == [5, 3, 4, 5, 6, 7, 0, 1, 2]
    # decode pos 5 -> block 3 offset 1; chunk pos 3 -> block 7 offset 3, pos 4..7 -> block 2; last -> block 5.
    assert meta.slot_mapping.tolist() == [13, 31, 8, 9, 10, 11, 20, 21, 22]
    assert meta.query_start_loc.tolist() == [0, 1, 6, 9]
    assert meta.seq_lens.tolist() == [6, 8, 3] and meta.seq_lens_list == [6, 8, 3]
    assert meta.block_tables.tolist() == [[9, 3], [7, 2], [5, 0]]
    assert meta.query_lens_list == [1, 5, 3] and meta.max_query_len == 5 and meta.max_seq_len == 8
    assert rows == [0, 2], "the partial chunk samples nothing"
    assert logits_indices == [0, 8]


# ------------------------------------------------------------------ HF equivalence (all three models)


def test_single_requests_match_hf(mut):
    engine = make_engine(mut.loaded)
    for prompt, max_tokens in mut.mixed_prompts()[:3]:
        tokens, _ = run(engine, [(prompt, greedy(max_tokens))])
        assert tokens["req-0"] == mut.hf_greedy(prompt, max_tokens)
        engine = make_engine(mut.loaded)  # fresh ids and cache for the next prompt
    assert engine.num_kv_blocks_used == 0


def test_concurrent_mixed_requests_match_hf(mut):
    engine = make_engine(mut.loaded, max_num_batched_tokens=128)
    requests = [(p, greedy(m)) for p, m in mut.mixed_prompts()]
    tokens, steps = run(engine, requests)
    for i, (prompt, max_tokens) in enumerate(mut.mixed_prompts()):
        assert tokens[f"req-{i}"] == mut.hf_greedy(prompt, max_tokens), f"request {i} (prompt {len(prompt)})"
    assert max(len(outs) for outs in steps) >= 8, "continuous batching: many requests sample in one step"
    assert engine.num_kv_blocks_used == 0 and engine.num_running == 0


def test_chunked_prefill_matches_hf(mut):
    prompt = (mut.text_ids * 2)[:300]
    engine = make_engine(mut.loaded, max_num_batched_tokens=64)
    tokens, steps = run(engine, [(prompt, greedy(8))])
    first_output_step = next(i for i, outs in enumerate(steps) if outs)
    assert first_output_step == 4, "300 tokens at 64 per step: 5 chunks, and only the last one samples"
    assert tokens["req-0"] == mut.hf_greedy(prompt, 8)
    assert metric(engine, "tandem_computed_prompt_tokens_total") == 300


def test_prefix_cache_hit_keeps_tokens_identical(mut):
    shared = mut.text_ids[:200]
    first = shared + mut.text_ids[210:215]
    second = shared + mut.text_ids[230:241]
    engine = make_engine(mut.loaded)
    tokens_a, _ = run(engine, [(first, greedy(6))])
    assert metric(engine, "tandem_prefix_cache_hit_tokens_total") == 0
    engine.add_request("second", second, greedy(10))
    got = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.extend(out.new_token_ids)
            cached = out.num_cached_tokens
    assert cached == 192, "12 full blocks of the shared 200-token prefix"
    assert metric(engine, "tandem_prefix_cache_hit_tokens_total") == 192
    assert metric(engine, "tandem_prefix_cache_queried_tokens_total") == len(first) + len(second)
    assert metric(engine, "tandem_computed_prompt_tokens_total") == len(first) + len(second) - 192
    assert tokens_a["req-0"] == mut.hf_greedy(first, 6)
    assert got == mut.hf_greedy(second, 10)


def test_a_burst_behind_one_new_prefix_computes_it_once_with_the_same_tokens(tiny_llama):
    """Four requests arriving together behind one new 200-token prefix: the first computes it, the others wait
    a step or two for its blocks and compute only their own tokens. Their tokens are those of the same burst
    on an engine where each computes the prefix itself."""
    prefix = [(7 * i) % 250 + 3 for i in range(200)]
    requests = [(prefix + [11 + i, 12 + i, 13 + i], greedy(5)) for i in range(4)]
    computed, tokens = {}, {}
    for waits in (True, False):
        engine = make_engine(tiny_llama, max_num_batched_tokens=1024)  # room for all four in one step
        engine.block_manager.wait_for_blocks_being_computed = waits
        tokens[waits], _ = run(engine, requests)
        computed[waits] = metric(engine, "tandem_computed_prompt_tokens_total")
        if waits:
            assert metric(engine, "tandem_prefix_cache_hit_tokens_total") == 3 * 192, "12 full blocks, 3 times"
    assert tokens[True] == tokens[False]
    assert computed[False] == 4 * 203
    assert computed[True] == 203 + 3 * (203 - 192)


def test_preemption_keeps_tokens_identical(mut):
    # 8 blocks of 16 tokens for six requests that need up to 3 blocks each: they must take turns,
    # and a request preempted mid-decode recomputes its prompt and the tokens it already produced.
    subset = [0, 2, 4, 5, 7, 9]
    prompts = [mut.mixed_prompts()[i] for i in subset]
    engine = make_engine(mut.loaded, num_kv_blocks=8, max_num_batched_tokens=128)
    for i, (prompt, max_tokens) in enumerate(prompts):
        engine.add_request(f"req-{i}", prompt, greedy(max_tokens))
    tokens = {f"req-{i}": [] for i in range(len(prompts))}
    preempted_mid_decode = set()
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        preempted_mid_decode |= {s.request_id for s in engine.scheduler.waiting if s.num_output_tokens}
    assert engine.num_preemptions > 0 and preempted_mid_decode
    assert metric(engine, "tandem_preemptions_total") == engine.num_preemptions
    for i, (prompt, max_tokens) in enumerate(prompts):
        assert tokens[f"req-{i}"] == mut.hf_greedy(prompt, max_tokens), f"request {subset[i]}"
    assert engine.num_kv_blocks_used == 0


# ------------------------------------------------------------------ behaviour (tiny Llama)


def test_abort_frees_blocks_at_once(tiny_llama):
    engine = make_engine(tiny_llama, max_num_seqs=2)
    ids = tiny_llama.tokenizer.encode(TEXT, add_special_tokens=False)
    for i in range(4):
        engine.add_request(f"r{i}", ids[i * 20:i * 20 + 40], greedy(50))
    engine.step()
    engine.step()
    assert engine.num_kv_blocks_used > 0 and engine.num_running == 2 and engine.num_waiting == 2
    for i in range(4):
        assert engine.abort_request(f"r{i}")
    assert engine.num_kv_blocks_used == 0 and engine.num_running == 0 and engine.num_waiting == 0
    assert metric(engine, "tandem_kv_blocks_used") == 0
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["r0", "r1", "r2", "r3"]
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert not engine.abort_request("r0"), "aborting twice is a no-op"
    assert metric(engine, "tandem_requests_finished_total", finish_reason="abort") == 4


def test_stop_conditions(tiny_llama):
    tok = tiny_llama.tokenizer
    prompt = tok.encode(TEXT, add_special_tokens=False)[:20]
    engine = make_engine(tiny_llama)
    [free_run] = engine.generate([prompt], greedy(12))
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 12 and free_run.stop_reason is None
    assert free_run.text == tok.decode(free_run.token_ids)

    # A stop token id: generation ends on it and reports it.
    stop_id = free_run.token_ids[5]
    first = free_run.token_ids.index(stop_id)
    [stopped] = engine.generate([prompt], greedy(12, stop_token_ids=[stop_id]))
    assert stopped.finish_reason == "stop" and stopped.token_ids == free_run.token_ids[:first + 1]
    assert stopped.stop_reason == stop_id  # vLLM's stop_reason: which stop ended it

    # EOS stops unless ignore_eos; the tiny model has eos id 2 - make it the stop by declaring it EOS.
    engine.eos_token_ids = frozenset({stop_id})
    [eos] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    assert eos.finish_reason == "stop" and eos.token_ids == free_run.token_ids[:first + 1]
    assert eos.stop_reason is None  # EOS is no stop of the client's
    [listed] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id]))
    assert listed.stop_reason is None  # an EOS the client also listed is still EOS (as in vLLM)
    [ignored] = engine.generate([prompt], greedy(12))
    assert ignored.token_ids == free_run.token_ids

    # A stop string cuts the text exactly before it.
    text = free_run.text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    if stop:
        [cut] = engine.generate([prompt], greedy(12, stop=[stop]))
        assert cut.finish_reason == "stop" and cut.text == text[:text.index(stop)] and cut.stop_reason == stop
        [kept] = engine.generate([prompt], greedy(12, stop=[stop], include_stop_str_in_output=True))
        assert kept.text == text[:text.index(stop) + len(stop)]
    assert engine.num_kv_blocks_used == 0


def test_add_request_validation(tiny_llama):
    engine = make_engine(tiny_llama, max_model_len=64, num_kv_blocks=8)
    engine.add_request("a", [5, 6, 7], greedy(4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [5, 6, 7], greedy(4))
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        engine.add_request("b", list(range(10, 70)), greedy(5))
    with pytest.raises(ValueError, match="no tokens"):
        engine.add_request("c", [], greedy(4))
    with pytest.raises(ValueError, match="token ids must lie"):
        engine.add_request("d", [tiny_llama.config.vocab_size], greedy(4))
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        make_engine(tiny_llama, max_model_len=tiny_llama.config.max_position_embeddings + 1)


def test_an_aborted_requests_id_is_taken_until_its_last_output_is_given_out(tiny_llama):
    """Found by a randomized engine fuzzer: the abort's output comes at the next step, and a new request under
    the same id added meanwhile would have been ended by it for a caller matching outputs by id."""
    engine = make_engine(tiny_llama, max_model_len=64, num_kv_blocks=8)
    engine.add_request("x", [5, 6, 7], greedy(4))
    engine.step()
    assert engine.abort_request("x")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [5, 6, 7], greedy(4))
    assert [(out.request_id, out.finish_reason) for out in engine.step()] == [("x", "abort")]
    engine.add_request("x", [5, 6, 7], greedy(4))  # free again once given out
    assert [out.finish_reason for out in engine.step()] == [None]


def test_the_context_is_what_the_kv_cache_holds(tiny_llama, caplog):
    """One sequence must fit the cache whole, or a request within the context would be refused for want of blocks
    (a chat request's default max_tokens fills the context). A limit the user set past the cache is refused at
    start; the model's own is lowered to the cache, and the worker says so."""
    with pytest.raises(ValueError, match="max_model_len=256 does not fit: the KV cache holds 32 tokens"):
        make_engine(tiny_llama, max_model_len=256, num_kv_blocks=2)
    with caplog.at_level("WARNING"):
        small = make_engine(tiny_llama, num_kv_blocks=2)
    assert small.max_model_len == 32 < tiny_llama.config.max_position_embeddings
    assert "serving a context of 32 tokens, not the model's 512" in caplog.text
    with pytest.raises(ValueError, match="exceeds max_model_len 32"):
        small.add_request("long", list(range(10, 40)), greedy(8))
    [whole] = small.generate([list(range(10, 26))], greedy(16))  # exactly the cache
    assert len(whole.token_ids) == 16 and small.num_kv_blocks_used == 0
    assert make_engine(tiny_llama, max_model_len=32, num_kv_blocks=2).max_model_len == 32


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama):
    prompt = tiny_llama.tokenizer.encode(TEXT, add_special_tokens=False)[:15]
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    [alone] = make_engine(tiny_llama).generate([prompt], params)
    mates = [SamplingParams(temperature=1.2, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=7, max_tokens=5, ignore_eos=True)]
    other_prompts = [prompt[:5], prompt[3:], prompt[::-1]]
    results = make_engine(tiny_llama, seed=123).generate([other_prompts[0], prompt, *other_prompts[1:]],
                                                         [mates[0], params, *mates[1:]])
    assert results[1].token_ids == alone.token_ids


def test_logprobs_are_reported_per_token(tiny_llama):
    prompt = tiny_llama.tokenizer.encode(TEXT, add_special_tokens=False)[:10]
    [result] = make_engine(tiny_llama).generate([prompt], greedy(5, logprobs=3))
    assert len(result.logprobs) == 5
    for token_id, lp in zip(result.token_ids, result.logprobs, strict=True):
        assert lp.token_id == token_id and len(lp.top_logprobs) == 3
        assert lp.top_logprobs[0][0] == token_id, "greedy picks the most likely token"
        assert lp.logprob == pytest.approx(lp.top_logprobs[0][1]) and lp.logprob <= 0


def test_metrics_are_updated(tiny_llama):
    engine = make_engine(tiny_llama, num_kv_blocks=64)
    prompts = [tiny_llama.tokenizer.encode(TEXT, add_special_tokens=False)[i:i + 12] for i in (0, 30, 60)]
    results = engine.generate(prompts, greedy(5))
    assert all(r.finish_reason == "length" for r in results)
    assert metric(engine, "tandem_prompt_tokens_total") == 36
    assert metric(engine, "tandem_generation_tokens_total") == 15
    assert metric(engine, "tandem_requests_finished_total", finish_reason="length") == 3
    assert metric(engine, "tandem_time_to_first_token_seconds_count") == 3
    assert metric(engine, "tandem_inter_token_latency_seconds_count") == 12
    assert metric(engine, "tandem_e2e_request_latency_seconds_count") == 3
    assert metric(engine, "tandem_request_queue_time_seconds_count") == 3
    assert metric(engine, "tandem_time_to_first_token_seconds_sum") > 0
    assert metric(engine, "tandem_kv_blocks_total") == 64
    assert metric(engine, "tandem_kv_blocks_used") == 0
    assert metric(engine, "tandem_num_requests_running") == 0
    assert metric(engine, "tandem_num_requests_waiting") == 0
    engine.add_request("w", prompts[0], greedy(3))
    assert metric(engine, "tandem_num_requests_waiting") == 1
    engine.step()
    assert metric(engine, "tandem_num_requests_running") == 1
    assert metric(engine, "tandem_kv_blocks_used") == 1


def test_prompt_logprobs_are_the_models_own_over_chunks_and_cached_blocks(mut):
    """Each prompt token's logprob as HF computes it from the positions before it, for a prompt prefilled in
    several chunks, and the same again when the prompt's blocks are cached: a request that wants them computes
    its whole prompt (no prefix-cache hit)."""
    prompt = mut.text_ids[:100]
    with torch.inference_mode():
        reference = torch.log_softmax(mut.hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = make_engine(mut.loaded, max_num_batched_tokens=32)
    for _ in range(2):  # the second time, every full block of the prompt is in the cache
        _, steps = run(engine, [(prompt, greedy(2, prompt_logprobs=3))])
        [first] = [out for outs in steps for out in outs if out.prompt_logprobs is not None]
        entries = first.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None and first.num_cached_tokens == 0
        got = torch.tensor([entry.logprob for entry in entries[1:]])
        torch.testing.assert_close(got, reference[torch.arange(len(prompt) - 1), prompt[1:]], rtol=0, atol=1e-3)
        assert [t for t, _ in entries[50].top_logprobs] == reference[49].topk(3).indices.tolist()
