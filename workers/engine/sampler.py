"""Batched token sampling over float32 logits [B, V].

Greedy rows take the argmax. Random rows are scaled by temperature, cut by top-k then top-p,
and sampled with the exponential-race trick (argmax of p / E, E ~ Exp(1)), which is one
vectorised pass and lets each seeded row draw its noise from its own generator: a seeded
request gets the same tokens whatever else is in the batch. A row's logit_bias, min_tokens,
penalties (presence, frequency, repetition) and grammar change its logits before any of this,
greedy rows included. Logprobs describe the model's raw distribution (log_softmax of the unmodified logits),
as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.protocol import SamplingParams


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero each row's tokens less likely than min_p[row] x its likeliest token (vLLM's min_p; 0 keeps all). A ratio
    to the top token, so it does not matter whether top-k/top-p renormalised the row first."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) what top-k [B] (V = off) and top-p [B] (1.0 = off) exclude, row by row."""
    if top_p is None:
        assert top_k is not None
        # top-k alone needs only the k-th largest value per row, not a full sort.
        top_values = logits.topk(int(top_k.max()), dim=-1).values
        kth = top_values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[-1] - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    # Drop the least likely tokens while what remains still holds at least top_p of the mass;
    # the most likely token always survives.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass
class History:
    """What a row's penalties and min_tokens read (SamplingParams.reads_history)."""

    tokens: list[int]  # the prompt, then the output so far
    output_start: int  # where the output starts in `tokens`
    stop_token_ids: frozenset[int] = frozenset()  # what min_tokens holds back (EOS unless ignored, stop_token_ids)
    # tokens[:output_start] as a tensor, kept by the caller from step to step: a long prompt is then not turned
    # into a tensor again at every step of a request with a repetition penalty.
    prompt_ids: torch.Tensor | None = None


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams],
                  histories: Sequence[History | None] | None,
                  allowed: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """The logits each row samples from: its logit_bias added, the tokens that would stop it masked while it has
    fewer than min_tokens, then its penalties applied (vLLM's order). `allowed` (rows, [len(rows), V] bool: a
    structured output's grammar, tandem.workers.engine.grammar) keeps the tokens it does not allow at -inf
    whatever these add; and should min_tokens leave a grammar row nothing at all, the grammar wins (what it allows
    is then only the end). A copy when any row has one of these; rows with none are unchanged. `histories` is
    needed only when a row reads_history."""
    rows = [i for i, p in enumerate(params) if p.logit_bias or p.reads_history]
    if not rows and allowed is None:
        return logits
    out = logits.clone()
    if allowed is not None:
        grammar_rows, mask = allowed
        if len(grammar_rows) == out.shape[0]:  # every row: in place, no gather and scatter of the batch
            out.masked_fill_(~mask, float("-inf"))
        else:
            out[grammar_rows] = out[grammar_rows].masked_fill(~mask, float("-inf"))
    for i in rows:
        p, row = params[i], out[i]
        if p.logit_bias:
            tokens, biases = zip(*p.logit_bias, strict=True)
            row.index_put_((torch.tensor(tokens, device=out.device),),
                           torch.tensor(biases, dtype=out.dtype, device=out.device), accumulate=True)
        if not p.reads_history:
            continue
        history = histories[i]
        made = len(history.tokens) - history.output_start
        if made < p.min_tokens and history.stop_token_ids:
            row[torch.tensor(sorted(history.stop_token_ids), device=out.device)] = float("-inf")
        if p.penalized:
            apply_penalties(row, p, history)
    if allowed is not None and rows:
        grammar_rows, mask = allowed
        dead = torch.isneginf(out[grammar_rows]).all(dim=-1)
        if dead.any():
            stuck = [row for row, is_dead in zip(grammar_rows, dead.tolist(), strict=True) if is_dead]
            out[stuck] = logits[stuck].masked_fill(~mask[dead], float("-inf"))
    return out


def apply_penalties(row: torch.Tensor, p: SamplingParams, history: History) -> None:
    """One row's penalties, in place, as vLLM and OpenAI define them. repetition_penalty r on every token seen,
    prompt or output: a positive logit is divided by r, a negative one multiplied (r > 1 makes any seen token less
    likely). frequency_penalty f and presence_penalty p on the output so far: a token generated c times loses
    c * f + p (p once, however often)."""
    output = torch.tensor(history.tokens[history.output_start:], dtype=torch.int64, device=row.device)
    if p.repetition_penalty != 1.0:
        prompt = history.prompt_ids
        if prompt is None:
            prompt = torch.tensor(history.tokens[:history.output_start], dtype=torch.int64)
        # A token seen twice is read and written twice, with the same value: no need to make them unique.
        seen = torch.cat([prompt.to(row.device), output])
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and len(output):
        made, counts = output.unique(return_counts=True)
        row[made] -= (p.frequency_penalty * counts + p.presence_penalty).to(row)


# Below this a temperature is greedy in all but name, and dividing by it could overflow (vLLM's epsilon).
_MIN_TEMPERATURE = 1e-5


def _argmax(x: torch.Tensor) -> torch.Tensor:
    # Same result as argmax (the first maximum wins), but torch's CPU max-with-indices kernel is
    # faster than argmax over a [B, vocab] batch.
    return x.max(dim=-1).indices


class Sampler:
    def __init__(self, seed: int = 0, device: str | torch.device = "cpu"):
        # Unseeded requests share one generator, so a whole engine run is reproducible from config.seed.
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None],
                 histories: Sequence[History | None] | None = None,
                 allowed: tuple[list[int], torch.Tensor] | None = None) -> SamplerOutput:
        """`histories` (see adjust_logits) is needed only when a row reads_history (penalties, min_tokens);
        `allowed` only when a row's output follows a grammar."""
        if logits.dim() != 2 or logits.shape[0] != len(params):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} requests")
        scores = adjust_logits(logits, params, histories, allowed)
        random_rows = [i for i, p in enumerate(params) if not (p.greedy or p.temperature < _MIN_TEMPERATURE)]
        tokens = _argmax(scores)
        if random_rows:
            sampled = self._sample(scores, random_rows, params, generators)
            if len(random_rows) == len(params):
                tokens = sampled
            else:
                tokens[random_rows] = sampled
        token_ids = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(params)
        if any(p.logprobs is not None for p in params):
            self._fill_logprobs(logprobs, logits, token_ids, params)
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, rows: list[int], params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        batch = len(params)
        vocab = logits.shape[-1]
        x = logits if len(rows) == batch else logits[rows]
        temperatures = torch.tensor([params[i].temperature for i in rows], dtype=x.dtype, device=x.device)
        x = x / temperatures.unsqueeze(1)

        ks = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in rows]
        ps = [params[i].top_p for i in rows]
        top_k = torch.tensor(ks, dtype=torch.int64, device=x.device) if min(ks) < vocab else None
        top_p = torch.tensor(ps, dtype=x.dtype, device=x.device) if min(ps) < 1.0 else None
        if top_k is not None or top_p is not None:
            x = apply_top_k_top_p(x, top_k, top_p)
        probs = x.softmax(dim=-1)
        min_ps = [params[i].min_p for i in rows]
        if max(min_ps) > 0:
            probs = apply_min_p(probs, torch.tensor(min_ps, dtype=probs.dtype, device=probs.device))

        noise = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(rows):
            gen = generators[i]
            if gen is None:
                unseeded.append(j)
            else:
                noise[j].exponential_(generator=gen)
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self.generator)
        elif unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab, dtype=noise.dtype,
                                          device=noise.device).exponential_(generator=self.generator)
        # An Exp(1) draw of exactly 0 would turn a masked token's 0/0 into NaN, which argmax picks.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return _argmax(probs.div_(noise))

    @staticmethod
    def _fill_logprobs(out: list[TokenLogprobs | None], logits: torch.Tensor, token_ids: list[int],
                       params: Sequence[SamplingParams]) -> None:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        entries = token_logprobs(logits[rows], [token_ids[i] for i in rows], [params[i].logprobs for i in rows])
        for i, entry in zip(rows, entries, strict=True):
            out[i] = entry


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_tops: list[int]) -> list[TokenLogprobs]:
    """Row i's log-softmax at token_ids[i], with its num_tops[i] likeliest alternatives: one host copy of each
    result for the whole batch (the sampler's output tokens, a chunk's prompt tokens)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    num_top = max(num_tops, default=0)
    if num_top:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(token_id, chosen[j], list(zip(top_ids[j][:n], top_values[j][:n], strict=True)) if n else [])
            for j, (token_id, n) in enumerate(zip(token_ids, num_tops, strict=True))]
