"""Speculative decoding through LLMEngine: outputs exactly as without it, with drafts accepted and rejected.

The random tiny Llama copies nothing, so n-gram drafts are rarely right on it: its tests draft with an oracle that
knows the plain run's output and spoils some of it (every path: all kept, some kept, none). The real SmolLM2
copies a repeated text, which is where n-gram drafts are accepted. Engines that speculate are given a memory-bound
step cost model (a GPU's at low batch), where drafts pay, so that what they verify does not hang on how fast this
host ran the tiny model's steps; the tests of the cost model's say are at the end.
"""

from __future__ import annotations

import json

import pytest
import torch

from tandem.config import EngineConfig
from tandem.metrics import EngineMetrics
from tandem.protocol import SamplingParams, StructuredOutput
from tandem.step_cost import StepCost
from tandem.workers.engine.llm_engine import LLMEngine
from tandem.workers.models.loader import load_model

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1})
TEXT = ("The keeper climbed the tower each evening, trimmed the wick, polished the lens and wrote the weather into "
        "the log. Storms cut the station off for weeks, so the keeper baked bread and mended nets.")
COPY_TEXT = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
             "\nRepeat the code above exactly:\n\ndef add(a, b):\n")

MEMORY_BOUND = StepCost(base_s=0.01, token_s=1e-4, sequence_s=0.0, pair_s=0.0, decode_base_s=0.02,
                        decode_sequence_s=0.0002, decode_pair_s=0.0)
FREE_ROWS = StepCost(base_s=0.01, token_s=1e-4, sequence_s=0.0, pair_s=0.0, decode_base_s=0.02,
                     decode_sequence_s=0.0, decode_pair_s=0.0)
TENTH_A_ROW = StepCost(base_s=0.01, token_s=1e-4, sequence_s=0.0, pair_s=0.0, decode_base_s=0.02,
                       decode_sequence_s=0.002, decode_pair_s=0.0)
COMPUTE_BOUND = StepCost(base_s=0.01, token_s=1e-4, sequence_s=0.0, pair_s=0.0, decode_base_s=0.002,
                         decode_sequence_s=0.004, decode_pair_s=0.0)


class OracleProposer:
    """Drafts a known continuation of each prompt, with every `spoil`-th output position's draft wrong."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], prompt_len: dict[tuple[int, ...], int],
                 spoil: int = 5):
        self.continuations = continuations
        self.prompt_len = prompt_len
        self.spoil = spoil

    def propose(self, token_ids, max_tokens):
        drafts = []
        for tokens, k in zip(token_ids, max_tokens, strict=True):
            key = next((p for p, n in self.prompt_len.items() if tuple(tokens[:n]) == p), None)
            if key is None:
                drafts.append([])
                continue
            made = len(tokens) - self.prompt_len[key]
            known = self.continuations[key][made:made + k]
            drafts.append([t + 1 if (made + j) % self.spoil == self.spoil - 1 else t for j, t in enumerate(known)])
        return drafts


@pytest.fixture(scope="module")
def tiny_llama(tiny_llama_dir):
    return load_model(tiny_llama_dir, dtype="float32")


def make_engine(loaded, spec: str | None = None, cost: StepCost = MEMORY_BOUND, **overrides) -> LLMEngine:
    settings = dict(num_kv_blocks=512, max_num_batched_tokens=256, max_num_seqs=16, speculative_config=spec)
    settings.update(overrides)
    engine = LLMEngine(loaded, EngineConfig(**settings), EngineMetrics(loaded.config.name, "both"))
    if spec is not None:
        engine.step_costs.cost = lambda: cost
    return engine


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompts_of(tokenizer, n: int = 6) -> list[list[int]]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    return [ids[i * 3:i * 3 + 8 + 5 * i] for i in range(n)]


def with_oracle(loaded, prompts, params, plain, spoil=5, **overrides) -> LLMEngine:
    engine = make_engine(loaded, NGRAM, **overrides)
    engine.proposer = OracleProposer({tuple(p): r.token_ids for p, r in zip(prompts, plain, strict=True)},
                                     {tuple(p): len(p) for p in prompts}, spoil)
    return engine


def assert_same(plain, spec, logprobs: bool = False):
    for i, (a, b) in enumerate(zip(plain, spec, strict=True)):
        assert b.token_ids == a.token_ids, f"request {i}"
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason), f"request {i}"
        if logprobs:
            assert len(b.logprobs) == len(a.logprobs)
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
                assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]


def test_greedy_with_drafts_kept_and_rejected_is_token_for_token_the_same(tiny_llama):
    prompts = prompts_of(tiny_llama.tokenizer)
    params = greedy(30)
    plain = make_engine(tiny_llama).generate(prompts, params)
    # Every third wrong: drafts of 1 to 4 tokens cannot settle into a rhythm that steps over the wrong ones.
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=3)
    spec = engine.generate(prompts, params)
    assert_same(plain, spec)
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.num_generation_tokens == sum(len(r.token_ids) for r in plain)
    assert engine.num_kv_blocks_used == 0
    m = engine.metrics
    labels = m.labels
    assert m.registry.get_sample_value("tandem_spec_decode_num_accepted_tokens_total", labels) == \
        stats.num_accepted_tokens
    assert m.registry.get_sample_value("vllm:spec_decode_num_draft_tokens_total",
                                       {"model_name": labels["model"]}) == stats.num_draft_tokens
    assert m.registry.get_sample_value("tandem_spec_decode_num_accepted_tokens_per_pos_total",
                                       {**labels, "position": "0"}) == stats.accepted_per_position[0] > 0


def test_ngram_greedy_is_the_same_on_a_random_model(tiny_llama):
    prompts = prompts_of(tiny_llama.tokenizer, 3)
    plain = make_engine(tiny_llama).generate(prompts, greedy(20))
    engine = make_engine(tiny_llama, NGRAM)
    assert_same(plain, engine.generate(prompts, greedy(20)))
    assert engine.spec_stats.num_drafts > 0 and engine.num_kv_blocks_used == 0


def test_chunked_prefill_prefix_hits_and_preemption_with_drafts(tiny_llama):
    ids = tiny_llama.tokenizer.encode(TEXT, add_special_tokens=False)
    shared = ids[:40]  # 2 full blocks of 16 every request shares: prefix hits
    prompts = [shared + ids[40 + i:44 + 3 * i] for i in range(6)]
    params = greedy(40)
    settings = dict(num_kv_blocks=12, max_num_batched_tokens=24, max_num_seqs=6)  # chunks; too few blocks for all
    plain_engine = make_engine(tiny_llama, **settings)
    plain = plain_engine.generate(prompts, params)
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=4, **settings)
    spec = engine.generate(prompts, params)
    assert_same(plain, spec)
    assert engine.num_preemptions > 0 and engine.num_prefix_hit_tokens > 0
    assert engine.spec_stats.num_accepted_tokens > 0
    assert engine.num_kv_blocks_used == 0


@pytest.mark.parametrize("spoil", [1, 3, 100])  # no draft right, some, all
def test_stop_strings_stop_tokens_and_max_tokens_mid_draft(tiny_llama, spoil):
    tok = tiny_llama.tokenizer
    prompt = tok.encode(TEXT, add_special_tokens=False)[:12]
    [free_run] = make_engine(tiny_llama).generate([prompt], greedy(16))
    text = free_run.text
    cases = [greedy(n) for n in range(1, 14)]
    cases += [greedy(16, stop=[text[i:i + 3]]) for i in range(2, len(text) - 3, max(1, len(text) // 6))]
    cases += [greedy(16, stop=[text[5:8]], include_stop_str_in_output=True),
              greedy(16, stop_token_ids=[free_run.token_ids[6]]), greedy(16, min_tokens=4, stop_token_ids=[
                  free_run.token_ids[2]])]
    prompts = [prompt] * len(cases)
    plain = make_engine(tiny_llama).generate(prompts, cases)
    engine = with_oracle(tiny_llama, [prompt], greedy(16), [free_run], spoil=spoil)
    spec = engine.generate(prompts, cases)
    assert_same(plain, spec)
    assert engine.spec_stats.num_drafts > 0 and engine.num_kv_blocks_used == 0


def test_logprobs_penalties_and_logit_bias_are_the_same(tiny_llama):
    prompts = prompts_of(tiny_llama.tokenizer, 4)
    params = [greedy(20, logprobs=3), greedy(20, repetition_penalty=1.3, presence_penalty=0.5),
              greedy(20, frequency_penalty=0.7, logprobs=1), greedy(20, logit_bias=[(13, 2.5), (42, 3.0)])]
    plain = make_engine(tiny_llama).generate(prompts, params)
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=4)
    assert_same(plain, engine.generate(prompts, params), logprobs=True)
    assert engine.spec_stats.num_accepted_tokens > 0


def test_seeded_sampling_emits_the_same_tokens_with_speculation(tiny_llama):
    prompts = prompts_of(tiny_llama.tokenizer, 4)
    params = [SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.8, seed=11, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.2, seed=3, max_tokens=20, ignore_eos=True,
                             repetition_penalty=1.2),
              SamplingParams(temperature=1.2, top_k=3, seed=5, max_tokens=20, ignore_eos=True, logit_bias=[(9, 1.0)])]
    plain = make_engine(tiny_llama).generate(prompts, params)
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=4)
    assert_same(plain, engine.generate(prompts, params))
    assert engine.spec_stats.num_accepted_tokens > 0


def exact_distribution(folder: str, prompt: list[int], top_k: int, temperature: float, length: int
                       ) -> dict[tuple[int, ...], float]:
    """Every `length`-token continuation's probability under top-k / temperature sampling, from HF's logits."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = {(): 1.0}
    for _ in range(length):
        grown = {}
        for prefix, prob in out.items():
            with torch.inference_mode():
                logits = model(torch.tensor([prompt + list(prefix)])).logits[0, -1]
            values, ids = logits.topk(top_k)
            for p, t in zip((values / temperature).softmax(-1).tolist(), ids.tolist(), strict=True):
                grown[(*prefix, t)] = prob * p
        out = grown
    return out


def test_sampled_outputs_follow_the_target_distribution(tiny_llama, tiny_llama_dir):
    # 3 tokens, top-k 3: 27 outcomes. 3000 unseeded draws with the oracle drafting the likeliest path. Bound: total
    # variation distance to the exact distribution < 0.05 (sampling noise alone is about 0.03 at this size), and
    # Pearson's chi-square under its 99.9% quantile for 26 degrees of freedom (54.05), outcomes of p < 1% pooled.
    prompt = prompts_of(tiny_llama.tokenizer, 1)[0]
    exact = exact_distribution(tiny_llama_dir, prompt, top_k=3, temperature=1.0, length=3)
    likeliest = list(max(exact, key=exact.get))
    n = 3000
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    engine = make_engine(tiny_llama, NGRAM, max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=1024,
                         cost=FREE_ROWS)  # at a batch of 3000 only rows that cost nothing are worth verifying
    engine.proposer = OracleProposer({tuple(prompt): likeliest}, {tuple(prompt): len(prompt)}, spoil=100)
    counts: dict[tuple[int, ...], int] = {}
    for r in engine.generate([prompt] * n, params):
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert engine.spec_stats.num_accepted_tokens > n // 20  # the second token's draft, right about 1 time in 10
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts.get(o, 0) / n - p) for o, p in exact.items())
    chi2, pooled_obs, pooled_exp = 0.0, 0, 0.0
    for o, p in exact.items():
        if p < 0.01:
            pooled_obs, pooled_exp = pooled_obs + counts.get(o, 0), pooled_exp + n * p
        else:
            chi2 += (counts.get(o, 0) - n * p) ** 2 / (n * p)
    if pooled_exp:
        chi2 += (pooled_obs - pooled_exp) ** 2 / pooled_exp
    print(f"TV {tv:.4f}, chi-square {chi2:.1f}")
    assert tv < 0.05 and chi2 < 54.05, (tv, chi2)


def test_structured_outputs_are_not_drafted_for(tiny_llama):
    structured = StructuredOutput(kind="regex", value="[0-9]{6}")
    prompts = prompts_of(tiny_llama.tokenizer, 2)
    params = [SamplingParams(temperature=0.0, max_tokens=10, structured=structured), greedy(10)]
    plain = make_engine(tiny_llama).generate(prompts, params)
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=100)
    assert_same(plain, engine.generate(prompts, params))
    assert engine.spec_stats.num_drafts > 0
    assert engine.spec_stats.num_drafts <= len(plain[1].token_ids)  # the regex request never drafted


def test_ngram_on_smollm2_copies_with_accepted_drafts(smollm2):
    prompt = smollm2.tokenizer.encode(COPY_TEXT, add_special_tokens=False)
    params = greedy(32)
    plain = make_engine(smollm2).generate([prompt], params)
    engine = make_engine(smollm2, NGRAM)
    assert_same(plain, engine.generate([prompt], params))
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 8, (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert engine.num_kv_blocks_used == 0


def test_k_adapts_to_each_sequence_and_failing_drafts_pause(tiny_llama):
    prompts = prompts_of(tiny_llama.tokenizer, 2)
    params = greedy(60)
    plain = make_engine(tiny_llama).generate(prompts, params)
    right = with_oracle(tiny_llama, prompts[:1], params, plain[:1], spoil=1000)
    assert_same(plain[:1], right.generate(prompts[:1], params))
    assert right.spec_stats.mean_accepted_length > 4  # all right: k stays at 4 (the last steps have less room)
    # Never right, where a row costs a tenth of a step: its k falls from 2 to 1 as its rate does, then it pauses
    # for 4, 8, 16, 16... steps with a one-draft retry after each.
    wrong = with_oracle(tiny_llama, prompts[1:], params, plain[1:], spoil=1, cost=TENTH_A_ROW)
    assert_same(plain[1:], wrong.generate(prompts[1:], params))
    stats = wrong.spec_stats
    assert stats.num_accepted_tokens == 0
    assert stats.num_drafts <= 11 and stats.num_draft_tokens <= 12, (stats.num_drafts, stats.num_draft_tokens)


def test_speculation_turns_off_where_the_step_cost_model_says_verifying_costs_more(tiny_llama):
    prompts = prompts_of(tiny_llama.tokenizer, 8)
    params = greedy(20)
    plain = make_engine(tiny_llama).generate(prompts, params)
    # Every other draft wrong: a ~ 1/2, at a row's 4 ms against the batch's 8 tokens in 34 ms. (A draft that is
    # always right pays under any model: a token for a row, where a plain step pays the base too.)
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=2, cost=COMPUTE_BOUND)
    assert_same(plain, engine.generate(prompts, params))
    stats, m = engine.spec_stats, engine.metrics
    assert stats.num_drafts == 0 and stats.num_skipped_steps > 0
    assert m.registry.get_sample_value("tandem_spec_decode_num_skipped_steps_total", m.labels) == \
        stats.num_skipped_steps
    assert m.registry.get_sample_value("tandem_spec_decode_mean_k", m.labels) == 0.0
    # The same drafts under a memory-bound model are verified.
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=2)
    assert_same(plain, engine.generate(prompts, params))
    assert engine.spec_stats.num_skipped_steps == 0 and engine.spec_stats.num_accepted_tokens > 0


def test_drafts_dropped_by_the_plan_still_teach_the_acceptance_estimate(tiny_llama):
    # A batch of 8 where a row costs a quarter of the step's base: drafts at the prior's 1/2 do not pay, drafts
    # that are always right do. The dropped first drafts are checked against the sampled tokens, so the estimate
    # climbs and the batch starts verifying.
    prompts = prompts_of(tiny_llama.tokenizer, 8)
    params = greedy(30)
    plain = make_engine(tiny_llama).generate(prompts, params)
    cost = StepCost(base_s=0.01, token_s=1e-4, sequence_s=0.0, pair_s=0.0, decode_base_s=0.008,
                    decode_sequence_s=0.002, decode_pair_s=0.0)
    engine = with_oracle(tiny_llama, prompts, params, plain, spoil=1000, cost=cost)
    assert_same(plain, engine.generate(prompts, params))
    stats = engine.spec_stats
    assert stats.num_skipped_steps > 0 and stats.num_accepted_tokens > 0
