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

Random rows draw by the exponential race, which seeded rows take from their own generator, so a
seeded request samples the same tokens whatever else shares its batch.

The step avoids full passes over the vocabulary where it can, since on CPU each costs about as
much as the arithmetic: penalties touch only the tokens seen; the filters share one softmax;
no row is sorted unless its top-p nucleus is wider than its 256 most likely tokens. Each step
builds only small tensors from the requests' parameters; no Python loop runs over the
vocabulary.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ladle.runtime.sampling_params import SamplingParams
from ladle.runtime.sequence import Sequence

_NEG_INF = float("-inf")
# Top-p candidates per row; wider nuclei fall back to a full sort.
_TOP_P_CANDIDATES = 256


@dataclass
class TokenLogprobs:
    """One chosen token (sampled, or the actual next prompt token) and its log-probability.

    ``rank`` (1 = most likely) and the top alternatives are filled only when logprobs were
    requested for this sequence.
    """

    token_id: int
    # None where nobody asked for it (no logprobs requested, no best_of ranking).
    logprob: float | None
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
    logits: torch.Tensor, chosen: torch.Tensor, num_top: SequenceOf[int | None]
) -> list[TokenLogprobs]:
    """The log-probability of each row's chosen token under ``log_softmax(logits)``, plus rank
    and top-N where asked (``num_top`` per row, None for neither)."""
    norm = logits.logsumexp(dim=-1)
    chosen_logit = logits.gather(-1, chosen[:, None])[:, 0]
    results = [
        TokenLogprobs(t, lp)
        for t, lp in zip(chosen.tolist(), (chosen_logit - norm).tolist(), strict=True)
    ]
    asked = [i for i, n in enumerate(num_top) if n is not None]
    if not asked:
        return results
    sub = logits[asked]
    ranks = ((sub > chosen_logit[asked, None]).sum(-1) + 1).tolist()
    width = max(n or 0 for n in num_top)
    top_logits, top_ids = sub.topk(width, dim=-1)
    top_lps = top_logits - norm[asked, None]
    for j, i in enumerate(asked):
        n = num_top[i] or 0
        results[i].rank = ranks[j]
        results[i].top_token_ids = top_ids[j, :n].tolist()
        results[i].top_logprobs = top_lps[j, :n].tolist()
    return results


class Sampled(Protocol):
    """What the sampler reads of a sequence (a ``Sequence``, or one seen ahead of drafts)."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def seed(self) -> int | None: ...
    @property
    def seq_id(self) -> int: ...


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    def _generator(self, seq: Sampled) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            assert seq.seed is not None
            gen = torch.Generator(device=self.device).manual_seed(seq.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> list[TokenLogprobs]:
        """Sample one token per row of ``logits`` (one row per sequence, in order).

        The raw logits are copied only if a mask, bias or penalty will change them, and a
        logprob is computed only for the rows that use it."""
        raw = logits.float()
        edits = any(_edits_logits(s.params) for s in seqs)
        tokens, rows, probs = self._select(raw.clone() if edits else raw, seqs)
        if rows:
            tokens[rows] = self._draw(probs, [seqs[i] for i in rows])
        need = [i for i, s in enumerate(seqs) if s.params.needs_logprob]
        if len(need) == len(seqs):
            return token_logprobs(raw, tokens, [s.params.logprobs for s in seqs])
        results = [TokenLogprobs(t, None) for t in tokens.tolist()]
        if need:
            computed = token_logprobs(
                raw[need], tokens[need], [seqs[i].params.logprobs for i in need]
            )
            for i, result in zip(need, computed, strict=True):
                results[i] = result
        return results

    def verify(
        self, logits: torch.Tensor, seqs: SequenceOf[Sequence], drafts: SequenceOf[list[int]]
    ) -> list[list[TokenLogprobs]]:
        """Speculative decoding's verification: per sequence, the draft tokens it accepts and
        one token more (the correction at the first rejection, or a bonus after the last).

        ``logits`` holds ``len(draft) + 1`` rows per sequence, in order: row j predicts the
        token after the sequence extended by its first j draft tokens, and is processed as
        that sequence (penalties, ``min_tokens``, bad words see those tokens as output). A
        greedy row accepts the draft token that is its argmax, so greedy output is the same
        token for token. A random row accepts a draft token d with probability p(d) and on
        rejection draws from p with d removed: the rejection sampling of Leviathan et al. for
        a drafter that proposes d with certainty, which leaves the distribution unchanged."""
        views = [
            _Ahead(seq, draft[:j]) for seq, draft in zip(seqs, drafts, strict=True)
            for j in range(len(draft) + 1)
        ]  # fmt: skip
        raw = logits.float()
        edits = any(_edits_logits(s.params) for s in seqs)
        greedy, random_rows, probs = self._select(raw.clone() if edits else raw, views)
        by_row = {row: i for i, row in enumerate(random_rows)}
        chosen: list[tuple[int, int]] = []  # (row, token)
        counts: list[int] = []
        row = 0
        for seq, draft in zip(seqs, drafts, strict=True):
            taken = 0
            for j in range(len(draft) + 1):
                offered = draft[j] if j < len(draft) else None
                token = self._verify_row(seq, row + j, offered, greedy, probs, by_row)
                chosen.append((row + j, token))
                taken += 1
                if token != offered:
                    break
            counts.append(taken)
            row += len(draft) + 1
        rows = torch.tensor([r for r, _ in chosen], device=logits.device)
        tokens = torch.tensor([t for _, t in chosen], device=logits.device)
        num_top = [
            seq.params.logprobs if seq.params.needs_logprob else None
            for seq, n in zip(seqs, counts, strict=True)
            for _ in range(n)
        ]
        if any(seq.params.needs_logprob for seq in seqs):
            scored = token_logprobs(raw[rows], tokens, num_top)
        else:
            scored = [TokenLogprobs(t, None) for t in tokens.tolist()]
        out, start = [], 0
        for n in counts:
            out.append(scored[start : start + n])
            start += n
        return out

    def _verify_row(
        self,
        seq: Sequence,
        row: int,
        offered: int | None,
        greedy: torch.Tensor,
        probs: torch.Tensor,
        by_row: dict[int, int],
    ) -> int:
        """The token of one row: ``offered`` when accepted, else a draw (or the argmax)."""
        if row not in by_row:
            return int(greedy[row])
        p = probs[by_row[row]]
        generator = self._generator(seq) if seq.seed is not None else None
        if offered is not None:
            accept = float(p[offered]) / float(p.sum())
            u = float(torch.rand((), generator=generator, device=p.device))
            if u < accept:
                return offered
            p = p.clone()
            p[offered] = 0.0
        race = torch.empty_like(p).exponential_(generator=generator)
        return int((p / race).argmax())

    def distribution(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> torch.Tensor:
        """The distribution each row's token is drawn from (one-hot for greedy rows), for
        inspection; the step itself never builds the greedy rows' one-hots."""
        tokens, rows, probs = self._select(logits.to(torch.float32, copy=True), seqs)
        dist = torch.zeros_like(logits, dtype=torch.float32)
        dist.scatter_(-1, tokens[:, None], 1.0)
        if rows:
            dist[rows] = probs / probs.sum(dim=-1, keepdim=True)
        return dist

    def _select(
        self, logits: torch.Tensor, seqs: SequenceOf[Sampled]
    ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """Process ``logits`` in place: the greedy pick of every row, and the rows to sample
        at random with their (unnormalized) probabilities."""
        logits = self.penalize(self.constrain(logits, seqs), seqs)
        greedy = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not rows:
            return greedy, rows, logits[:0]
        params = [seqs[i].params for i in rows]
        temperature = torch.tensor([p.temperature for p in params], device=self.device)
        probs = (logits[rows] / temperature[:, None]).softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            probs = self._min_p(probs, [p.min_p for p in params])
        if any(p.top_k for p in params):
            probs = self._top_k(probs, [p.top_k for p in params])
        if any(p.top_p < 1.0 for p in params):
            probs = self._top_p(probs, [p.top_p for p in params])
        return greedy, rows, probs

    def constrain(self, logits: torch.Tensor, seqs: SequenceOf[Sampled]) -> torch.Tensor:
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

    def penalize(self, logits: torch.Tensor, seqs: SequenceOf[Sampled]) -> torch.Tensor:
        """vLLM's ``apply_penalties``: repetition over prompt and output, frequency and presence
        (OpenAI's definitions) over the output. Only the logits of tokens seen are touched."""
        rows = [i for i, s in enumerate(seqs) if s.params.has_penalties]
        if not rows:
            return logits
        picked = [seqs[i] for i in rows]
        vocab = logits.shape[-1]
        out_rows, out_ids = _flat_index(rows, [s.output_token_ids for s in picked], self.device)
        prompt_rows, prompt_ids = _flat_index(
            rows, [s.prompt_token_ids for s in picked], self.device
        )
        # One flat key per (row, token); output occurrences count, prompt ones only mark.
        keys = torch.cat([out_rows * vocab + out_ids, prompt_rows * vocab + prompt_ids])
        weights = torch.cat([torch.ones_like(out_ids), torch.zeros_like(prompt_ids)])
        seen, inverse = torch.unique(keys, return_inverse=True)
        counts = torch.zeros_like(seen).index_add_(0, inverse, weights).to(logits.dtype)

        def per_key(name: str, neutral: float) -> torch.Tensor:
            values = torch.full((len(seqs),), neutral, device=self.device)
            values[rows] = torch.tensor([getattr(s.params, name) for s in picked])
            return values[seen // vocab]

        repetition = per_key("repetition_penalty", 1.0)
        flat = logits.view(-1)
        values = flat[seen]
        values = torch.where(values > 0, values / repetition, values * repetition)
        values -= per_key("frequency_penalty", 0.0) * counts
        values -= per_key("presence_penalty", 0.0) * (counts > 0).to(values.dtype)
        flat[seen] = values
        return logits

    def _draw(self, probs: torch.Tensor, seqs: SequenceOf[Sampled]) -> torch.Tensor:
        """The exponential race (as vLLM draws): ``argmax(p / E)`` with ``E ~ Exp(1)`` picks
        token i with probability p_i, from the row's own generator when it is seeded.
        ``probs`` need not sum to one. An inverse-CDF draw moves to a neighbouring token when
        rounding anywhere below the drawn point changes, and a batch of another size does
        round the GEMMs differently; the race changes its pick only on a near-exact tie."""
        race = torch.empty_like(probs).exponential_()
        for j, seq in enumerate(seqs):
            if seq.seed is not None:
                race[j].exponential_(generator=self._generator(seq))
        return probs.div_(race).argmax(dim=-1)

    # The filters work on probabilities after temperature, each on what the previous ones kept
    # (renormalizing changes no comparison below, so it is left to the draw).

    def _min_p(self, probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
        """Drop tokens less likely than ``min_p`` times the most likely one."""
        scale = torch.tensor(min_p, device=self.device)[:, None]
        return probs.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * scale, 0.0)

    def _top_k(self, probs: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        """Keep tokens at least as likely as the k-th (ties at the k-th are kept, as in vLLM).
        Only the rows with a k below the vocabulary take part: one row without top-k must not
        turn the batch's top-k into a sort of the whole vocabulary."""
        vocab = probs.shape[-1]
        rows = [i for i, t in enumerate(top_k) if 0 < t < vocab]
        if not rows:
            return probs
        k = torch.tensor([top_k[i] for i in rows], device=self.device)
        sub = probs[rows]
        kth = sub.topk(int(k.max()), dim=-1).values.gather(-1, k[:, None] - 1)
        probs[rows] = sub.masked_fill(sub < kth, 0.0)
        return probs

    def _top_p(self, probs: torch.Tensor, top_p: list[float]) -> torch.Tensor:
        """Keep the smallest set of most likely tokens whose mass reaches p: a token stays when
        the mass of the tokens more likely than it is below p (vLLM's rule)."""
        p = torch.tensor(top_p, device=self.device, dtype=probs.dtype)
        target = p * probs.sum(dim=-1)
        width = min(_TOP_P_CANDIDATES, probs.shape[-1])
        top_probs, top_ids = probs.topk(width, dim=-1)
        mass = top_probs.cumsum(dim=-1)
        filtered = p < 1.0
        inside = filtered & (mass[:, -1] >= target)
        if inside.any():
            rows = inside.nonzero()[:, 0]
            keep = (mass[rows] - top_probs[rows]) < target[rows, None]
            kept = torch.where(keep, top_probs[rows], 0.0)
            probs[rows] = torch.zeros_like(probs[rows]).scatter_(-1, top_ids[rows], kept)
        wide = filtered & ~inside
        if wide.any():
            rows = wide.nonzero()[:, 0]
            probs[rows] = self._top_p_sorted(probs[rows], target[rows])
        return probs

    def _top_p_sorted(self, probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Top-p over a full sort, for nuclei wider than the candidates."""
        ordered, order = probs.sort(dim=-1, descending=True)
        mass = ordered.cumsum(dim=-1)
        ordered = ordered.masked_fill(mass - ordered >= target[:, None], 0.0)
        return torch.zeros_like(probs).scatter_(-1, order, ordered)


@dataclass
class _Ahead:
    """A sequence as it would stand after ``draft``: what the sampler reads of it."""

    seq: Sequence
    draft: list[int]

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.draft if self.draft else self.seq.output_token_ids

    @property
    def seed(self) -> int | None:
        return self.seq.seed

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


def _edits_logits(params: SamplingParams) -> bool:
    """Whether masks, bias or penalties may change this row's logits."""
    return bool(
        params.allowed_token_ids
        or params.bad_words_token_ids
        or params.logit_bias
        or params.min_tokens
        or params.has_penalties
    )


def _banned_tokens(seq: Sampled) -> list[int]:
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
