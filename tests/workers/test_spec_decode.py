"""Speculative decoding's parts without a model: n-gram lookup, config, verification against exact probabilities,
and the scheduler and block manager with drafts (no block leaked)."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.cli import main
from tandem.cli.args import options_to_args
from tandem.config import EngineConfig, SpeculativeConfig
from tandem.hashing import model_seed
from tandem.protocol import SamplingParams
from tandem.workers.engine.block_manager import BlockManager
from tandem.workers.engine.sampler import Sampler
from tandem.workers.engine.scheduler import Scheduler
from tandem.workers.engine.sequence import Sequence
from tandem.workers.engine.spec_decode import make_proposer
from tandem.workers.engine.spec_decode.ngram import NgramProposer, ngram_lookup
from tandem.workers.engine.spec_decode.verify import draft_limit, num_accepted

# ------------------------------------------------------------------ n-gram lookup


def test_ngram_lookup_takes_the_longest_then_latest_match():
    #          0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 8, 2, 3, 7, 6, 5, 2, 3]
    assert ngram_lookup(tokens, 1, 3, 2) == [7, 6]  # [2, 3]: latest earlier match at 5
    assert ngram_lookup(tokens + [7], 1, 3, 3) == [6, 5, 2]  # [2, 3, 7] matches (3 tokens)
    assert ngram_lookup(tokens, 3, 3, 2) == []  # no 3-token match of [5, 2, 3]
    assert ngram_lookup([4, 5, 4, 5, 4], 2, 2, 5) == [5, 4]  # what follows, up to the end
    assert ngram_lookup([1, 2, 3], 1, 4, 2) == []
    assert ngram_lookup([7, 7], 1, 1, 3) == [7]
    assert ngram_lookup(tokens, 1, 3, 0) == []


def test_ngram_proposer_drafts_per_sequence():
    proposer = make_proposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=2, prompt_lookup_min=1))
    assert isinstance(proposer, NgramProposer) and (proposer.min_n, proposer.max_n) == (1, 2)
    assert proposer.propose([[1, 2, 3, 1, 2], [5, 6]], [3, 3]) == [[3, 1, 2], []]


def test_verification_keeps_drafts_up_to_the_first_disagreement():
    assert num_accepted([4, 5, 6], [4, 5]) == 2
    assert num_accepted([4, 9, 6], [4, 5]) == 1
    assert num_accepted([9, 5, 6], [4, 5]) == 0


def test_draft_limit_leaves_room_for_max_tokens_and_the_context():
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=5))
    assert draft_limit(seq, 4, 100) == 4  # 4 drafts + the target's token = 5
    seq.append_token(4)
    assert draft_limit(seq, 4, 100) == 3
    assert draft_limit(seq, 4, 6) == 1  # 4 tokens known, 2 more fit: one draft and the target's
    seq.prefill_only = True
    assert draft_limit(seq, 4, 100) == 0


# ------------------------------------------------------------------ config


def test_speculative_config_as_vllm_takes_it():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    spec = config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 4, 4, 4)
    both = SpeculativeConfig(num_speculative_tokens=2)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    assert EngineConfig().speculative is None
    # `tandem serve` passes it on to its workers as it was given.
    assert options_to_args(config)[-2:] == ["--speculative-config", config.speculative_config]


@pytest.mark.parametrize(("text", "said"), [
    ("{bad", "not valid JSON"),
    ("[4]", "must be a JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "unknown method 'eagle'; supported: ngram"),
    ('{"model": "/m", "num_speculative_tokens": 2}', "a draft model is not supported yet"),
    ('{"method": "ngram"}', "num_speculative_tokens: Field required"),
    ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min must be"),
    ('{"num_speculative_tokens": 2, "lookahead": 1}', "lookahead: Extra inputs"),
])
def test_a_bad_speculative_config_is_one_line_at_start(capsys, text, said):
    with pytest.raises(SystemExit) as exc:
        main(["worker", "--speculative-config", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tandem worker: --speculative-config: ") and said in err


# ------------------------------------------------------------------ verification against exact probabilities


def test_draft_acceptance_is_rejection_sampling_with_exact_probabilities():
    # One draft x against the target p (temperature, top-k, top-p applied): accepted with probability p(x), and
    # when rejected the token follows p without x, renormalised. 40000 draws; bounds: 4 standard errors on the
    # acceptance, total variation distance < 0.015 on the rejected tokens (noise alone is about 0.005).
    logits = torch.tensor([2.0, 1.5, 1.2, 0.3, -0.5, 0.9, -2.0, 1.0])
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.95, max_tokens=2)
    kept = logits.topk(6).indices
    p = torch.zeros_like(logits)
    p[kept] = (logits[kept] / 0.8).softmax(-1)
    order = p.argsort(descending=True)
    cumulative = p[order].cumsum(0)
    p[order[1:][cumulative[:-1] >= 0.95]] = 0  # top-p keeps the smallest head holding 0.95
    p /= p.sum()
    draft = int(order[1])
    n = 40_000
    sampled = Sampler(seed=1)(logits.expand(n, -1).contiguous(), [params] * n, [None] * n).token_ids
    accepted = [num_accepted([t], [draft]) for t in sampled]
    rate = sum(accepted) / n
    px = float(p[draft])
    assert abs(rate - px) < 4 * (px * (1 - px) / n) ** 0.5, (rate, px)
    rejected = [t for t, a in zip(sampled, accepted, strict=True) if not a]
    assert draft not in rejected
    residual = p.clone()
    residual[draft] = 0
    residual /= residual.sum()
    counts = torch.bincount(torch.tensor(rejected), minlength=len(logits)).double() / len(rejected)
    assert 0.5 * (counts - residual.double()).abs().sum() < 0.015


def test_draft_positions_sample_as_plain_decode_steps_would():
    seq = Sequence("a", [1, 2, 3], SamplingParams(temperature=1.0, seed=42, max_tokens=8))
    draws = [float(torch.rand(1, generator=g)) for g in seq.token_generators(3)]
    plain = []
    for token in (5, 6, 7):
        plain.append(float(torch.rand(1, generator=seq.next_token_generator())))
        seq.append_token(token)
    assert draws == plain


# ------------------------------------------------------------------ scheduler and block manager with drafts

BS = 4


def test_drafts_past_the_budget_are_dropped():
    bm = BlockManager(64, BS, model_seed("spec"))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=3)
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=20))
    sched.add(seq)
    out = sched.schedule()
    seq.num_computed_tokens = 3
    seq.append_token(4)
    seq.spec_token_ids = [5, 6, 7]
    out = sched.schedule()
    assert out.num_new_tokens == [3] and seq.spec_token_ids == [5, 6]


def test_drafts_go_before_anyone_is_preempted():
    bm = BlockManager(2, BS, model_seed("spec"))
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=32)
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_tokens=20))
    sched.add(seq)
    sched.schedule()
    seq.num_computed_tokens = 7
    seq.append_token(8)
    seq.spec_token_ids = [9, 10, 11]  # would need a third block
    out = sched.schedule()
    assert out.num_new_tokens == [1] and not out.preempted and seq.spec_token_ids == []


@pytest.mark.parametrize("seed", range(6))
def test_no_block_is_leaked_over_accepted_and_rejected_drafts_aborts_and_preemption(seed):
    rng = random.Random(seed)
    bm = BlockManager(24, BS, model_seed("spec"))
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=rng.choice([8, 16, 64]))
    prefix = [rng.randrange(50) for _ in range(8)]
    seqs = []
    for i in range(14):
        seq = Sequence(f"r{i}", prefix[:rng.randrange(9)] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))],
                       SamplingParams(max_tokens=rng.randrange(1, 30)))
        sched.add(seq)
        seqs.append(seq)
    preempted = 0
    for _ in range(2000):
        if not sched.num_unfinished:
            break
        for seq in sched.running:
            if seq.num_uncomputed_tokens == 1 and rng.random() < 0.7:
                seq.spec_token_ids = [rng.randrange(50) for _ in range(draft_limit(seq, 4, 10_000))]
        out = sched.schedule()
        preempted += len(out.preempted)
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
            seq.num_computed_tokens += n - len(drafts)
            bm.cache_computed_blocks(seq)
            if seq.num_uncomputed_tokens:
                continue
            accepted = rng.randrange(len(drafts) + 1)
            seq.num_computed_tokens += accepted
            for token in [*drafts[:accepted], rng.randrange(50)]:
                seq.append_token(token)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
                    break
            else:
                bm.cache_computed_blocks(seq)
                bm.trim(seq)
                assert bm.blocks_for(seq.num_computed_tokens) <= len(seq.block_table) <= bm.blocks_for(seq.num_tokens)
        if rng.random() < 0.03 and sched.running:
            sched.abort(rng.choice(sched.running).request_id)
        held = sum(len(s.block_table) for s in sched.running)
        assert bm.num_used_blocks <= held
    assert not sched.num_unfinished and bm.num_used_blocks == 0
    assert all(seq.is_finished for seq in seqs)
    if seed == 0:
        assert preempted > 0
