"""The sampler's distribution, checked number by number on tiny vocabularies.

Each expectation below is computed by hand from the parameter's definition (vLLM's, see
docs/sampling.md), not by running the code under test a second way.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from ladle.runtime.sampler import Sampler, token_logprobs
from ladle.runtime.sampling_params import SamplingParams

from .conftest import make_seq

CPU = torch.device("cpu")


def dist(logits: list[float], params: SamplingParams, **seq_kwargs: Any) -> list[float]:
    """The distribution the sampler draws from, for one row."""
    seq = make_seq(params, **seq_kwargs)
    probs = Sampler(CPU).distribution(torch.tensor([logits]), [seq])
    return [float(p) for p in probs[0]]


def softmax(values: list[float]) -> list[float]:
    finite = [v for v in values if v != -math.inf]
    top = max(finite)
    exps = [math.exp(v - top) if v != -math.inf else 0.0 for v in values]
    total = sum(exps)
    return [e / total for e in exps]


LOGITS = [2.0, -1.0, 0.5, 1.0]


def test_temperature_divides_the_logits() -> None:
    assert dist(LOGITS, SamplingParams(temperature=2.0)) == pytest.approx(
        softmax([1.0, -0.5, 0.25, 0.5]), abs=1e-6
    )


def test_greedy_is_one_hot_at_the_argmax() -> None:
    assert dist(LOGITS, SamplingParams(temperature=0)) == [1.0, 0.0, 0.0, 0.0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    # Token 1 (logit -1) is in the prompt, token 2 (0.5) in the output, token 3 (1.0) unseen.
    # Seen tokens: positive logits are divided by 2, negative multiplied by 2.
    got = dist(LOGITS, SamplingParams(repetition_penalty=2.0), prompt=[1], output=[2, 0])
    assert got == pytest.approx(softmax([1.0, -2.0, 0.25, 1.0]), abs=1e-6)


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    # Output has token 2 twice and token 0 once; token 1 only in the prompt (not penalized).
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    got = dist(LOGITS, params, prompt=[1], output=[2, 0, 2])
    expected = [2.0 - 0.5 * 1 - 0.25, -1.0, 0.5 - 0.5 * 2 - 0.25, 1.0]
    assert got == pytest.approx(softmax(expected), abs=1e-6)


def test_negative_presence_penalty_encourages_repeats() -> None:
    got = dist(LOGITS, SamplingParams(presence_penalty=-1.0), output=[1])
    assert got == pytest.approx(softmax([2.0, 0.0, 0.5, 1.0]), abs=1e-6)


def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    # Threshold 0.2 * 0.5 = 0.1: only the 0.05 token goes; the rest renormalize.
    got = dist(logits, SamplingParams(min_p=0.2))
    assert got == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0], abs=1e-6)


def test_min_p_applies_after_temperature() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    # At temperature 0.5 the probabilities square: 0.25, 0.09, 0.0225, 0.0025 (/0.365).
    # Threshold 0.1 * top: keeps 0.25 and 0.09 only.
    got = dist(logits, SamplingParams(min_p=0.1, temperature=0.5))
    assert got == pytest.approx([0.25 / 0.34, 0.09 / 0.34, 0.0, 0.0], abs=1e-6)


def test_logit_bias_is_added_to_the_logits() -> None:
    got = dist(LOGITS, SamplingParams(logit_bias={1: 3.0, 0: -100.0}))
    assert got == pytest.approx(softmax([-98.0, 2.0, 0.5, 1.0]), abs=1e-6)


def test_logit_bias_comes_before_the_repetition_penalty() -> None:
    # vLLM's order: bias first (-1 + 1.5 = 0.5 > 0), then the penalty divides: 0.25.
    params = SamplingParams(logit_bias={1: 1.5}, repetition_penalty=2.0)
    got = dist(LOGITS, params, prompt=[1], output=[1])
    assert got == pytest.approx(softmax([2.0, 0.25, 0.5, 1.0]), abs=1e-6)


def test_top_k_keeps_the_k_most_likely() -> None:
    assert dist(LOGITS, SamplingParams(top_k=2)) == pytest.approx(
        softmax([2.0, -math.inf, -math.inf, 1.0]), abs=1e-6
    )


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = [math.log(p) for p in probs]
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is the first two tokens.
    assert dist(logits, SamplingParams(top_p=0.7)) == pytest.approx(
        [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0], abs=1e-6
    )
    assert dist(logits, SamplingParams(top_p=0.4)) == pytest.approx([1.0, 0, 0, 0], abs=1e-6)


def test_top_k_keeps_ties_at_the_kth_logit() -> None:
    assert dist([1.0, 1.0, 1.0, 0.0], SamplingParams(top_k=2)) == pytest.approx(
        [1 / 3, 1 / 3, 1 / 3, 0.0], abs=1e-6
    )


def test_top_p_wider_than_the_candidates_sorts_the_row() -> None:
    """A flat row's nucleus (500 of 1000 tokens) exceeds the 256 candidates; a peaked row in
    the same batch stays on the fast path, and a top_p=1 row is untouched."""
    flat = torch.zeros(1000)
    peaked = torch.full((1000,), -20.0)
    peaked[:3] = torch.tensor([3.0, 2.0, 1.0])
    seqs = [make_seq(SamplingParams(top_p=p)) for p in (0.5, 0.5, 1.0)]
    probs = Sampler(CPU).distribution(torch.stack([flat, peaked, flat]), seqs)
    kept = probs[0][probs[0] > 0]
    assert len(kept) == 500
    assert kept.tolist() == pytest.approx([1 / 500] * 500)
    top = softmax([3.0, 2.0, 1.0] + [-20.0] * 997)
    # 0.665 >= 0.5 already: only the first token stays.
    assert top[0] > 0.5
    assert probs[1, :3].tolist() == pytest.approx([1.0, 0.0, 0.0], abs=1e-6)
    assert probs[2].tolist() == pytest.approx([1 / 1000] * 1000)


def test_allowed_token_ids_mask_everything_else() -> None:
    got = dist(LOGITS, SamplingParams(allowed_token_ids=[1, 2]))
    assert got == pytest.approx(softmax([-math.inf, -1.0, 0.5, -math.inf]), abs=1e-6)


def test_bad_words_ban_their_last_token_after_their_prefix() -> None:
    # Single-token word [3]: always banned. Word [0, 2]: token 2 banned only after a 0.
    words = [[3], [0, 2]]
    after_zero = dist(LOGITS, SamplingParams(), output=[1, 0], bad_words_token_ids=words)
    assert after_zero == pytest.approx(softmax([2.0, -1.0, -math.inf, -math.inf]), abs=1e-6)
    after_one = dist(LOGITS, SamplingParams(), output=[0, 1], bad_words_token_ids=words)
    assert after_one == pytest.approx(softmax([2.0, -1.0, 0.5, -math.inf]), abs=1e-6)


def test_min_tokens_suppresses_stop_tokens_until_reached() -> None:
    params = SamplingParams(min_tokens=2)
    early = dist(LOGITS, params, output=[1], all_stop_token_ids=[0, 3])
    assert early == pytest.approx(softmax([-math.inf, -1.0, 0.5, -math.inf]), abs=1e-6)
    late = dist(LOGITS, params, output=[1, 1], all_stop_token_ids=[0, 3])
    assert late == pytest.approx(softmax(LOGITS), abs=1e-6)


def test_rows_of_one_batch_get_their_own_parameters() -> None:
    seqs = [
        make_seq(SamplingParams(temperature=0)),
        make_seq(SamplingParams(top_k=1, temperature=1.0)),
        make_seq(SamplingParams(logit_bias={2: 10.0}, temperature=0)),
        make_seq(SamplingParams(temperature=2.0)),
    ]
    probs = Sampler(CPU).distribution(torch.tensor([LOGITS] * 4), seqs)
    assert probs[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert probs[1].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])
    assert probs[2].tolist() == [0.0, 0.0, 1.0, 0.0]
    assert probs[3].tolist() == pytest.approx(softmax([1.0, -0.5, 0.25, 0.5]), abs=1e-6)


def test_draws_follow_the_distribution() -> None:
    """Sampled tokens follow ``distribution``: 20k draws land within 4 sigma."""
    draws = 20_000
    params = SamplingParams(top_k=3)
    seqs = [make_seq(params) for _ in range(draws)]
    sampler = Sampler(CPU)
    tokens = torch.tensor([s.token_id for s in sampler(torch.tensor([LOGITS] * draws), seqs)])
    counts = torch.bincount(tokens, minlength=4).tolist()
    expected = dist(LOGITS, params)
    assert expected == pytest.approx(softmax([2.0, -math.inf, 0.5, 1.0]), abs=1e-6)
    for count, p in zip(counts, expected, strict=True):
        sigma = math.sqrt(draws * p * (1 - p)) or 1.0
        assert abs(count - draws * p) < 4 * sigma


def test_seeded_rows_draw_the_same_whatever_the_batch() -> None:
    vocab = 64
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    seeded = SamplingParams(seed=1234, temperature=1.0)

    def run(batch_size: int, position: int) -> list[int]:
        sampler = Sampler(CPU)
        seqs = [make_seq(SamplingParams(temperature=1.0)) for _ in range(batch_size)]
        mine = make_seq(seeded)
        seqs.insert(position, mine)
        noise = torch.randn(batch_size + 1, vocab)
        noise[position] = logits[0]
        return [int(sampler(noise, seqs)[position].token_id) for _ in range(20)]

    alone = run(0, 0)
    assert run(7, 3) == alone
    assert run(2, 2) == alone
    assert len(set(alone)) > 1


def test_logprobs_are_raw_with_rank_and_top_alternatives() -> None:
    # Penalties and temperature change what is sampled, not the reported logprobs (vLLM V1).
    params = SamplingParams(temperature=0, repetition_penalty=5.0, logprobs=2)
    seq = make_seq(params, output=[0])
    (result,) = Sampler(CPU)(torch.tensor([LOGITS]), [seq])
    raw = [math.log(p) for p in softmax(LOGITS)]
    # The penalty turns token 0's logit 2.0 into 0.4, so the greedy pick is token 3.
    assert result.token_id == 3
    assert result.logprob == pytest.approx(raw[3], abs=1e-6)
    assert result.rank == 2
    assert result.top_token_ids == [0, 3]
    assert result.top_logprobs == pytest.approx([raw[0], raw[3]], abs=1e-6)


def test_token_logprobs_only_fills_rank_and_top_where_asked() -> None:
    logprobs = torch.tensor([LOGITS, LOGITS]).log_softmax(-1)
    chosen = torch.tensor([1, 2])
    asked, not_asked = token_logprobs(logprobs, chosen, [0, None])
    assert asked.rank == 4
    assert asked.top_token_ids == []
    assert not_asked.rank is None
    assert not_asked.logprob == pytest.approx(float(logprobs[1, 2]))
