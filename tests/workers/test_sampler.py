"""Sampler: greedy, temperature, top-k, top-p, per-request seeds and raw-distribution logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from tandem.protocol import SamplingParams
from tandem.workers.engine.sampler import History, Sampler, adjust_logits, apply_min_p, apply_top_k_top_p

V = 50


def rand_logits(batch: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, V, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * 3


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_is_argmax():
    logits = rand_logits(4)
    out = Sampler()(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = rand_logits(6, seed=1)
    params = [SamplingParams(temperature=t, top_k=1) for t in (0.5, 1.0, 2.0, 5.0, 1.3, 0.1)]
    out = Sampler()(logits, params, [None] * 6)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_tiny_temperature_is_greedy_not_nan():
    logits = rand_logits(3, seed=9)
    out = Sampler()(logits, [SamplingParams(temperature=1e-30)] * 3, [None] * 3)
    assert out.token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy():
    logits = rand_logits(5, seed=2)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0), SamplingParams(temperature=0.0)]
    out = Sampler()(logits, params, [None] * 5)
    expected = logits.argmax(-1).tolist()
    assert [out.token_ids[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


def test_seeded_request_is_independent_of_its_batch_mates():
    logits = rand_logits(1, seed=3)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=30, seed=1234)

    def draw_alone(n):
        gen = seeded(1234)
        sampler = Sampler(seed=0)
        return [sampler(logits, [params], [gen]).token_ids[0] for _ in range(n)]

    def draw_in_batch(n):
        gen = seeded(1234)
        sampler = Sampler(seed=99)
        mates = [SamplingParams(temperature=1.5), SamplingParams(temperature=0.7, seed=5, top_p=0.5),
                 SamplingParams(temperature=0.0)]
        tokens = []
        for step in range(n):
            batch = torch.cat([rand_logits(1, seed=100 + step), logits, rand_logits(2, seed=200 + step)])
            out = sampler(batch, [mates[0], params, mates[1], mates[2]], [None, gen, seeded(step), None])
            tokens.append(out.token_ids[1])
        return tokens

    alone = draw_alone(40)
    assert draw_in_batch(40) == alone
    assert len(set(alone)) > 1, "a temperature-0.9 draw over 40 steps should not be constant"


def test_unseeded_sampling_is_reproducible_from_the_engine_seed():
    logits = rand_logits(8, seed=4)
    params = [SamplingParams(temperature=1.5)] * 8

    def run(seed):
        sampler = Sampler(seed=seed)
        return [sampler(logits, params, [None] * 8).token_ids for _ in range(5)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def empirical(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000, seed: int = 0) -> torch.Tensor:
    sampler = Sampler(seed=seed)
    batch = logits_row.expand(n, -1).contiguous()
    tokens = sampler(batch, [params] * n, [None] * n).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=logits_row.shape[-1]).float() / n


def test_temperature_sampling_matches_the_scaled_distribution():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    for temperature in (0.5, 1.0, 2.0):
        freq = empirical(logits, SamplingParams(temperature=temperature), n=8000)
        expected = torch.softmax(logits / temperature, -1)
        assert torch.allclose(freq, expected, atol=0.025), (temperature, freq, expected)


def test_top_k_only_samples_the_k_most_likely():
    logits = rand_logits(1, seed=5)[0]
    freq = empirical(logits, SamplingParams(temperature=3.0, top_k=4))
    allowed = set(logits.topk(4).indices.tolist())
    assert set(freq.nonzero().flatten().tolist()) == allowed


def test_top_p_keeps_the_smallest_set_holding_the_mass():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    logits = probs.log()
    freq = empirical(logits, SamplingParams(temperature=1.0, top_p=0.8), n=6000)
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed; the last two are cut.
    assert freq[3] == 0 and freq[4] == 0
    kept = probs[:3] / probs[:3].sum()
    assert torch.allclose(freq[:3], kept, atol=0.03)


def test_min_p_drops_what_is_less_likely_than_its_share_of_the_top_token():
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    freq = empirical(probs.log(), SamplingParams(temperature=1.0, min_p=0.2), n=6000)
    # The bar is 0.2 x 0.5 = 0.1: the last token is dropped, the rest keep their proportions.
    assert freq[3] == 0
    assert torch.allclose(freq[:3], probs[:3] / probs[:3].sum(), atol=0.03)
    assert set(empirical(probs.log(), SamplingParams(temperature=1.0, min_p=0.7), n=500).nonzero().flatten()
               .tolist()) == {0}


def test_min_p_is_per_row_and_zero_keeps_every_token():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]])
    kept = apply_min_p(probs, torch.tensor([0.0, 0.5]))
    assert kept[0].tolist() == probs[0].tolist() and (kept[1] > 0).tolist() == [True, True, False]


def test_top_p_always_keeps_the_top_token():
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.01]))
    assert masked[0, 0] == 5.0 and torch.isinf(masked[0, 1:]).all()


def test_top_k_and_top_p_together_per_row():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]]))
    masked = apply_top_k_top_p(logits, torch.tensor([3, 4]), torch.tensor([0.95, 0.5]))
    # row 0: top-3 first, then top-p 0.95 of the renormalised rest keeps all three.
    assert torch.isfinite(masked[0]).tolist() == [True, True, True, False]
    assert torch.isfinite(masked[1]).tolist() == [True, True, False, False]


def test_masked_tokens_are_never_sampled():
    logits = torch.full((1, V), -50.0)
    logits[0, 7] = 0.0
    logits[0, 9] = 0.0
    freq = empirical(logits[0], SamplingParams(temperature=1.0, top_k=2), n=20000)
    assert set(freq.nonzero().flatten().tolist()) <= {7, 9}


def test_logprobs_come_from_the_raw_distribution():
    logits = rand_logits(2, seed=6)
    params = [SamplingParams(temperature=0.3, top_k=3, logprobs=5), SamplingParams(temperature=0.0, logprobs=0)]
    out = Sampler()(logits, params, [None, None])
    raw = torch.log_softmax(logits, -1)
    first = out.logprobs[0]
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, raw[0, first.token_id].item(), rel_tol=1e-6)
    top_values, top_ids = raw[0].topk(5)
    assert [t for t, _ in first.top_logprobs] == top_ids.tolist()
    assert [lp for _, lp in first.top_logprobs] == pytest.approx(top_values.tolist())
    second = out.logprobs[1]
    assert second.top_logprobs == [] and second.token_id == logits[1].argmax().item()
    assert math.isclose(second.logprob, raw[1].max().item(), rel_tol=1e-6)


def test_logprobs_only_for_rows_that_ask():
    logits = rand_logits(3, seed=8)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0, logprobs=2),
              SamplingParams(temperature=0.0)]
    out = Sampler()(logits, params, [None] * 3)
    assert out.logprobs[0] is None and out.logprobs[2] is None
    assert len(out.logprobs[1].top_logprobs) == 2


def test_shape_mismatch_is_rejected():
    with pytest.raises(ValueError, match="do not match"):
        Sampler()(rand_logits(2), [SamplingParams()], [None])


def test_penalties_as_vllm_and_openai_define_them():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    history = History([0, 1, 0], 2)  # prompt [0, 1], output so far [0]
    params = SamplingParams(repetition_penalty=2.0)
    out = adjust_logits(logits, [params], [history])
    # seen tokens 0 and 1: positive logit halved, negative doubled; the rest untouched
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, -2.0, 1.0]]
    output = History([0, 1, 3, 5, 3], 2)  # output [3, 5, 3]
    out = adjust_logits(logits, [SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)], [output])
    assert out[0].tolist() == pytest.approx([2.0, -1.0, 0.5, 3.0 - 2 * 0.5 - 0.25, -2.0, 1.0 - 0.5 - 0.25])
    negative = adjust_logits(logits, [SamplingParams(frequency_penalty=-1.0)], [output])
    assert negative[0, 3].item() == 5.0  # a negative penalty favours repeats
    assert logits.tolist() == [[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]]  # the raw logits are left as they were


def test_penalties_steer_greedy_rows_but_not_their_logprobs_or_other_rows():
    logits = torch.tensor([[3.0, 2.9, 0.0], [3.0, 2.9, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=0), SamplingParams(temperature=0.0)]
    histories = [History([2, 0], 1), History([2, 0], 1)]  # both rows have generated token 0 once
    out = Sampler()(logits, params, [None, None], histories)
    assert out.token_ids == [1, 0]  # only the penalized row moves off its repeat
    raw = torch.log_softmax(logits[0], -1)
    assert math.isclose(out.logprobs[0].logprob, raw[1].item(), rel_tol=1e-6)


def test_logit_bias_is_added_before_the_penalties_and_can_ban_a_token():
    logits = torch.tensor([[2.0, 1.0, 0.5], [2.0, 1.0, 0.5]])
    params = [SamplingParams(logit_bias=[(0, -1.5), (2, 0.25)], repetition_penalty=2.0), SamplingParams()]
    out = adjust_logits(logits, params, [History([2], 1), History([2], 1)])
    # token 0: 2.0 - 1.5; token 2 (seen in the prompt): (0.5 + 0.25) / 2
    assert out[0].tolist() == pytest.approx([0.5, 1.0, 0.375]) and out[1].tolist() == logits[1].tolist()
    banned = Sampler()(logits[:1], [SamplingParams(temperature=0.0, logit_bias=[(0, -100.0)])], [None])
    assert banned.token_ids == [1]


def test_min_tokens_holds_back_what_would_stop_the_request_until_then():
    logits = torch.tensor([[1.0, 5.0, 4.0, 0.0]])  # token 1 is EOS here, token 2 a stop_token_id
    params = [SamplingParams(temperature=0.0, min_tokens=2)]
    stops = frozenset({1, 2})
    assert Sampler()(logits, params, [None], [History([7, 0], 1, stops)]).token_ids == [0]  # 1 made, 2 wanted
    assert Sampler()(logits, params, [None], [History([7, 0, 0], 1, stops)]).token_ids == [1]  # 2 made: free


def test_a_kept_prompt_tensor_penalizes_as_the_token_list_does():
    logits = rand_logits(1, seed=11)
    params = [SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3)]
    tokens = [3, 3, 9, 41, 9, 3]  # prompt [3, 3, 9, 41], output [9, 3]
    kept = History(tokens, 4, prompt_ids=torch.tensor(tokens[:4]))
    assert torch.equal(adjust_logits(logits, params, [kept]), adjust_logits(logits, params, [History(tokens, 4)]))
    assert not torch.equal(adjust_logits(logits, params, [kept]), logits)
