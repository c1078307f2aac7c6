"""Turn a batch of logits into next tokens and their log-probabilities, vectorized over the batch.

The order follows vLLM's V1 sampler, so that the same parameters pick the same distribution:

1. log-probabilities for the output are taken from the raw logits (vLLM's default
   ``raw_logprobs``), before any of the steps below;
2. ``allowed_token_ids``, ``bad_words`` and ``min_tokens`` (which suppresses the stop tokens)
   mask logits to -inf, and ``logit_bias`` is added;
3. penalties: ``repetition_penalty`` over prompt and output tokens, then ``frequency_penalty``
   and ``presence_penalty`` over output tokens;
4. greedy rows take the argmax here; random rows divide by ``temperature``, drop tokens whose
   probability is below ``min_p`` times the top one, then apply ``top_k`` and ``top_p``.

Random rows sample by the exponential race (``argmax(p / q)`` with ``q ~ Exp(1)``), which equals
a categorical draw and lets each seeded row draw its noise from its own generator, so a seeded
request samples the same tokens whatever else shares its batch. Each step builds only small
tensors from the requests' parameters; no Python loop runs over the vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

import torch

from ladle.runtime.sequence import Sequence

_NEG_INF = float("-inf")


@dataclass
class TokenLogprobs:
    """One chosen token (sampled, or the actual next prompt token) and its log-probability.

    ``rank`` (1 = most likely) and the top alternatives are filled only when logprobs were
    requested for this sequence.
    """

    token_id: int
    logprob: float
    rank: int | None = None
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


def _flat_index(
    rows: SequenceOf[int], lists: SequenceOf[SequenceOf[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) index tensors for per-row token lists, for one scatter over the batch."""
    lengths = torch.tensor([len(ids) for ids in lists], dtype=torch.long)
    row_index = torch.repeat_interleave(torch.tensor(list(rows), dtype=torch.long), lengths)
    token_index = torch.tensor(list(itertools.chain.from_iterable(lists)), dtype=torch.long)
    return row_index.to(device), token_index.to(device)


def token_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: SequenceOf[int | None]
) -> list[TokenLogprobs]:
    """The log-probability of each row's chosen token, plus rank and top-N where asked."""
    chosen_lp = logprobs.gather(-1, chosen[:, None])[:, 0]
    results = [
        TokenLogprobs(t, lp) for t, lp in zip(chosen.tolist(), chosen_lp.tolist(), strict=True)
    ]
    asked = [i for i, n in enumerate(num_top) if n is not None]
    if not asked:
        return results
    rows = torch.tensor(asked, device=logprobs.device)
    sub = logprobs[rows]
    ranks = ((sub > chosen_lp[rows, None]).sum(-1) + 1).tolist()
    width = max(n or 0 for n in num_top)
    top_lp, top_ids = sub.topk(width, dim=-1) if width else (sub[:, :0], sub[:, :0].long())
    # One device-to-host copy for all rows: a copy per request would sync per request.
    top_id_rows, top_lp_rows = top_ids.tolist(), top_lp.tolist()
    for j, i in enumerate(asked):
        n = num_top[i] or 0
        results[i].rank = ranks[j]
        results[i].top_token_ids = top_id_rows[j][:n]
        results[i].top_logprobs = top_lp_rows[j][:n]
    return results


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            assert seq.params.seed is not None
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> list[TokenLogprobs]:
        """Sample one token per row of ``logits`` (one row per sequence, in order)."""
        # One private fp32 copy, which every step below may change in place.
        logits = logits.to(torch.float32, copy=True)
        raw_logprobs = logits.log_softmax(dim=-1)
        tokens = self.draw(self.distribution(logits, seqs), seqs)
        return token_logprobs(raw_logprobs, tokens, [s.params.logprobs for s in seqs])

    def constrain(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """Apply allowed_token_ids, then bad_words and min_tokens (-inf), then logit_bias."""
        allowed = [i for i, s in enumerate(seqs) if s.params.allowed_token_ids]
        if allowed:
            lists = [seqs[i].params.allowed_token_ids or [] for i in allowed]
            rows, cols = _flat_index(range(len(allowed)), lists, self.device)
            keep = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool, device=self.device)
            keep[rows, cols] = True
            logits[allowed] = logits[allowed].masked_fill(~keep, _NEG_INF)
        rows_l: list[int] = []
        cols_l: list[int] = []
        values: list[float] = []
        for i, seq in enumerate(seqs):
            banned = _banned_tokens(seq)
            bias = seq.params.logit_bias or {}
            rows_l += [i] * (len(banned) + len(bias))
            cols_l += banned + list(bias)
            values += [_NEG_INF] * len(banned) + list(bias.values())
        if rows_l:
            index = (
                torch.tensor(rows_l, device=self.device),
                torch.tensor(cols_l, device=self.device),
            )
            logits.index_put_(index, torch.tensor(values, device=self.device), accumulate=True)
        return logits

    def penalize(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """vLLM's ``apply_penalties``: repetition over prompt and output, frequency and presence
        (OpenAI's definitions) over the output."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        picked = [seqs[i] for i in rows]
        local = range(len(rows))
        vocab = logits.shape[-1]
        counts = torch.zeros(len(rows), vocab, device=self.device)
        out_rows, out_ids = _flat_index(local, [s.output_token_ids for s in picked], self.device)
        counts.index_put_((out_rows, out_ids), torch.ones_like(out_ids, dtype=counts.dtype), True)
        seen = counts > 0
        prompt_rows, prompt_ids = _flat_index(
            local, [s.prompt_token_ids for s in picked], self.device
        )
        seen_anywhere = seen.clone()
        seen_anywhere[prompt_rows, prompt_ids] = True

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=self.device)[:, None]

        repetition = column([s.params.repetition_penalty for s in picked])
        frequency = column([s.params.frequency_penalty for s in picked])
        presence = column([s.params.presence_penalty for s in picked])
        sub = logits[rows]
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen_anywhere, penalized, sub)
        logits[rows] = sub - frequency * counts - presence * seen.to(sub.dtype)
        return logits

    def distribution(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """The distribution each row's next token is drawn from: one-hot at the processed
        argmax for greedy rows. Changes ``logits`` in place."""
        logits = self.penalize(self.constrain(logits, seqs), seqs)
        probs = torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return probs
        params = [seqs[i].params for i in random_rows]
        temperature = torch.tensor([p.temperature for p in params], device=self.device)
        scaled = logits[random_rows] / temperature[:, None]
        if any(p.min_p > 0 for p in params):
            scaled = self._min_p(scaled, [p.min_p for p in params])
        if any(p.top_k or p.top_p < 1.0 for p in params):
            scaled = self._top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
        probs[random_rows] = scaled.softmax(dim=-1)
        return probs

    def draw(self, probs: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """One token per row: the exponential race, with seeded rows' noise from their own
        generators; one-hot (greedy) rows need no noise."""
        tokens = probs.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return tokens
        picked = probs[random_rows]
        noise = torch.empty_like(picked).exponential_()
        for j, i in enumerate(random_rows):
            if seqs[i].params.seed is not None:
                noise[j].exponential_(generator=self._generator(seqs[i]))
        tokens[random_rows] = (picked / noise).argmax(dim=-1)
        return tokens

    def _min_p(self, logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
        """Drop tokens less likely than ``min_p`` times the most likely one (after temperature)."""
        probs = logits.softmax(dim=-1)
        threshold = (
            probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=self.device)[:, None]
        )
        return logits.masked_fill(probs < threshold, _NEG_INF)

    def _top_k_top_p(
        self, logits: torch.Tensor, top_k: list[int], top_p: list[float]
    ) -> torch.Tensor:
        """vLLM's ``apply_top_k_top_p``: one ascending sort; top-k keeps ties at the k-th value;
        top-p keeps the smallest set of most likely tokens whose mass reaches p."""
        vocab = logits.shape[-1]
        ordered, order = logits.sort(dim=-1, descending=False)
        k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=self.device)
        kth = ordered.gather(-1, (vocab - k)[:, None])
        ordered = ordered.masked_fill(ordered < kth, _NEG_INF)
        probs = ordered.softmax(dim=-1)
        p = torch.tensor(top_p, device=self.device, dtype=probs.dtype)[:, None]
        drop = probs.cumsum(dim=-1) <= 1 - p
        drop[:, -1] = False
        ordered = ordered.masked_fill(drop, _NEG_INF)
        return torch.empty_like(logits).scatter_(-1, order, ordered)


def _banned_tokens(seq: Sequence) -> list[int]:
    """Tokens this sequence may not sample next: stop tokens under ``min_tokens``, and the last
    token of each bad word whose other tokens end the output (vLLM's rule)."""
    params = seq.params
    output = seq.output_token_ids
    banned: list[int] = []
    if len(output) < params.min_tokens:
        banned += params.all_stop_token_ids
    for word in params.bad_words_token_ids:
        prefix = len(word) - 1
        if prefix <= len(output) and (prefix == 0 or output[-prefix:] == word[:-1]):
            banned.append(word[-1])
    return banned
