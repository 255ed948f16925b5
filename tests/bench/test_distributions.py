"""Length distributions, arrival processes and prompt building of `tandem bench`."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tandem.bench.distributions import arrival_times, parse_distribution
from tandem.bench.prompts import WORDS, PromptFactory, parse_token_id_range


@pytest.fixture
def rng():
    return np.random.default_rng(7)


def test_fixed_and_bare_numbers(rng):
    for spec in ("fixed:64", "64", 64):
        d = parse_distribution(spec)
        assert d.spec == "fixed:64" and d.mean == 64
        assert d.sample(rng, 5).tolist() == [64] * 5


def test_uniform_covers_its_inclusive_range(rng):
    d = parse_distribution("uniform:3:6")
    draws = d.sample(rng, 4000)
    assert set(draws.tolist()) == {3, 4, 5, 6}
    assert d.mean == 4.5 and abs(draws.mean() - 4.5) < 0.1


def test_lognormal_has_the_stated_mean_and_spread(rng):
    d = parse_distribution("lognormal:1000:0.5")
    draws = d.sample(rng, 200_000)
    assert d.mean == 1000
    assert abs(draws.mean() / 1000 - 1) < 0.01
    assert abs(np.log(draws).std() - 0.5) < 0.01  # sigma is the spread of the log, as documented
    assert draws.min() >= 1
    assert parse_distribution("lognormal:1:3").sample(rng, 1000).min() == 1  # floored at one token


def test_trace_replays_in_order_and_keeps_in_out_pairs(tmp_path, rng):
    path = tmp_path / "trace.jsonl"
    rows = [{"input_tokens": 10, "output_tokens": 3}, {"prompt_tokens": 20, "completion_tokens": 5},
            {"input_length": 30, "output_length": 7}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    inp, out = parse_distribution(f"trace:{path}", "input"), parse_distribution(f"trace:{path}", "output")
    assert inp.sample(rng, 5).tolist() == [10, 20, 30, 10, 20]
    assert out.sample(rng, 5).tolist() == [3, 5, 7, 3, 5]
    assert inp.mean == 20 and out.mean == 5


@pytest.mark.parametrize("spec, message", [
    ("fixed:0", "at least 1"),
    ("uniform:9:3", "1 <= A <= B"),
    ("lognormal:100:-1", "sigma must be >= 0"),
    ("lognormal:100", "must be N, fixed:N"),
    ("gamma:3:4", "must be N, fixed:N"),
    ("abc", "must be N, fixed:N"),
    ("fixed:x", "not an integer"),
    ("trace:/nonexistent/file.jsonl", "cannot read it"),
])
def test_bad_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_distribution(spec)


def test_trace_without_the_field_names_the_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input_tokens": 5}\n{"tokens": 4}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2: needs a positive integer input length"):
        parse_distribution(f"trace:{path}", "input")


def test_arrival_processes(rng):
    poisson = arrival_times("poisson", 50.0, 20_000, rng)
    assert poisson[0] == 0 and np.all(np.diff(poisson) >= 0)
    gaps = np.diff(poisson)
    assert abs(gaps.mean() * 50 - 1) < 0.03
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05  # exponential gaps: coefficient of variation 1
    assert np.allclose(arrival_times("constant", 4.0, 5, rng), [0, 0.25, 0.5, 0.75, 1.0])
    burst = arrival_times("burst", 4.0, 6, rng, burst_size=3)  # 3 at once, every 3/4 s
    assert np.allclose(burst, [0, 0, 0, 0.75, 0.75, 0.75])
    with pytest.raises(ValueError, match="positive number of requests per second"):
        arrival_times("poisson", 0.0, 3, rng)
    with pytest.raises(ValueError, match="must be poisson, constant or burst"):
        arrival_times("gusty", 1.0, 3, rng)


def test_prompts_have_the_wanted_length(rng):
    tokens = PromptFactory("tokens", rng, (100, 200)).make(37)
    assert len(tokens) == 37 and all(100 <= t < 200 for t in tokens)
    words = PromptFactory("words", rng).make(25)
    assert len(words.split()) == 25 and set(words.split()) <= set(WORDS)
    a, b = PromptFactory("tokens", rng).make(32), PromptFactory("tokens", rng).make(32)
    assert a[:16] != b[:16]  # random prompts share no cached prefix
    assert parse_token_id_range("5:9") == (5, 9)
    with pytest.raises(ValueError, match="LOW:HIGH"):
        parse_token_id_range("9")
