"""SamplingParams and BeamSearchParams: every bad value names its parameter and range."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ladle.runtime.sampling_params import (
    BeamSearchParams,
    SamplingParams,
    SamplingParamsError,
)


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"n": 0}, "n", ">= 1"),
        ({"n": 1.5}, "n", "integer"),
        ({"n": 3, "best_of": 2}, "best_of", ">= n"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": math.nan}, "temperature", ">= 0"),
        ({"top_p": 0.0}, "top_p", r"\(0, 1\]"),
        ({"top_p": 1.5}, "top_p", r"\(0, 1\]"),
        ({"top_k": -2}, "top_k", "-1 or 0"),
        ({"min_p": 1.5}, "min_p", r"\[0, 1\]"),
        ({"presence_penalty": 2.5}, "presence_penalty", r"\[-2, 2\]"),
        ({"frequency_penalty": -3}, "frequency_penalty", r"\[-2, 2\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "> 0"),
        ({"seed": -1}, "seed", r"\[0, 2\*\*63\)"),
        ({"stop": ["ok", ""]}, "stop", "non-empty"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
        ({"bad_words": [" "]}, "bad_words", "non-empty"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "<= max_tokens"),
        ({"logprobs": -1}, "logprobs", ">= 0"),
        ({"prompt_logprobs": -1}, "prompt_logprobs", ">= 0"),
        ({"logit_bias": {5: 101.0}}, "logit_bias", r"\[-100, 100\]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", ">= 0"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias", "token ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
        ({"allowed_token_ids": [3, -4]}, "allowed_token_ids", ">= 0"),
    ],
)
def test_bad_values_name_the_parameter_and_range(
    kwargs: dict[str, Any], param: str, message: str
) -> None:
    with pytest.raises(SamplingParamsError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}:")


def test_vllm_conventions_are_normalized() -> None:
    params = SamplingParams(stop="###", top_k=-1, logit_bias={"17": 2})  # type: ignore[arg-type, dict-item]
    assert params.stop == ["###"]
    assert params.top_k == 0
    assert params.logit_bias == {17: 2.0}
    assert params.num_samples == 1
    assert SamplingParams(n=2, best_of=5).num_samples == 5


def test_greedy_drops_filters_that_cannot_change_the_argmax() -> None:
    params = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert params.greedy
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)


def test_bind_adds_stop_tokens_and_bad_words_and_checks_the_vocabulary(tokenizer: Any) -> None:
    bound = SamplingParams(stop_token_ids=[7], bad_words=["hello world"]).bind(
        tokenizer, {2}, 49152
    )
    assert bound.all_stop_token_ids == {2, 7}
    plain = tokenizer.encode("hello world", add_special_tokens=False)
    spaced = tokenizer.encode(" hello world", add_special_tokens=False)
    # Both the start-of-text and the mid-text tokenizations are banned (vLLM's rule).
    assert bound.bad_words_token_ids == [plain, spaced]
    assert SamplingParams(ignore_eos=True).bind(tokenizer, {2}, 49152).all_stop_token_ids == set()
    # clone() keeps what bind() added.
    assert bound.clone(seed=3).all_stop_token_ids == {2, 7}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"stop_token_ids": [49152]}, "stop_token_ids"),
        ({"allowed_token_ids": [1, 60000]}, "allowed_token_ids"),
        ({"logit_bias": {50000: 1.0}}, "logit_bias"),
    ]
    for kwargs, param in cases:
        with pytest.raises(SamplingParamsError, match="< 49152") as info:
            SamplingParams(**kwargs).bind(tokenizer, {2}, 49152)
        assert info.value.param == param


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": math.inf}, "length_penalty"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_beam_search_params_are_validated(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        BeamSearchParams(**kwargs)
    assert info.value.param == param
