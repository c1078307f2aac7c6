"""Requests in: tokenize the prompt, check it and the parameters against the model, the engine
and the request limits, and hand the scheduler a :class:`Request` that cannot fail later for
its own reasons.

Everything that could go wrong for one request inside a step is checked here, derived values
included (fork seeds, beam candidates against the vocabulary, what a beam search holds in the
KV cache), so that a bad request is a 400 at the door rather than a failure mid-step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ladle.runtime.beam_search import BeamSearch
from ladle.runtime.errors import RequestError, require_text
from ladle.runtime.limits import RequestLimits
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams
from ladle.words import plural

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class Request:
    """A validated, tokenized request, ready for the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Set for beam search; ``params`` then describes how each beam is stepped.
    beam_params: BeamSearchParams | None = None
    # ``time.monotonic()`` after which the engine ends the request (finish reason "abort").
    deadline: float | None = None
    lora_request: LoRARequest | None = None
    # Which sample of an n > 1 request this is (``parallel_sampling``): it draws from seed + it.
    sample_index: int = 0


class InputProcessor:
    """Stateless apart from its configuration, so any thread may call it."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: set[int],
        max_model_len: int,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        scheduling_policy: str,
        limits: RequestLimits,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.scheduling_policy = scheduling_policy
        self.limits = limits

    def process(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline: float | None = None,
    ) -> Request:
        text, ids = self._tokenize(prompt)
        self._check_prompt(ids)
        if priority != 0 and self.scheduling_policy != "priority":
            raise RequestError(
                f"priority: only --scheduling-policy priority orders requests by priority; "
                f"this server schedules {self.scheduling_policy}, so priority must be 0",
                "priority",
            )
        if isinstance(params, BeamSearchParams):
            self._check_beam(params, len(ids))
            bound = self._beam_step_params(params)
        else:
            self._check_sampling(params)
            bound = params.bind(self.tokenizer, self.eos_token_ids, self.vocab_size)
        return Request(
            request_id,
            text,
            ids,
            bound,
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            params if isinstance(params, BeamSearchParams) else None,
            deadline,
        )

    # -- the prompt ---------------------------------------------------------------------

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(require_text(prompt, "prompt")))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise RequestError("prompt: must be a string", "prompt")
                return text, _token_ids(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                text = require_text(prompt["prompt"], "prompt")
                return text, list(self.tokenizer.encode(text))
            raise RequestError(
                "a prompt dict needs 'prompt' (a string) or 'prompt_token_ids'", "prompt"
            )
        return None, _token_ids(prompt)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if len(ids) > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {len(ids)} tokens",
                "prompt",
            )

    # -- parameters ---------------------------------------------------------------------

    def _check_sampling(self, params: SamplingParams) -> None:
        limits = self.limits
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limits.max_logprobs:
                raise RequestError(f"{name}: must be <= {limits.max_logprobs}, got {value}", name)
        name = "best_of" if params.best_of is not None else "n"
        _at_most(name, params.num_samples, limits.max_n, "--max-n")
        _at_most(name, params.num_samples, self.max_num_seqs, "--max-num-seqs")
        _at_most("stop", len(params.stop), limits.max_stop, "--max-stop", "strings")
        _at_most("stop_token_ids", len(params.stop_token_ids), limits.max_stop, "--max-stop")
        _at_most("bad_words", len(params.bad_words), limits.max_bad_words, "--max-bad-words")
        _at_most(
            "logit_bias", len(params.logit_bias or {}), limits.max_logit_bias, "--max-logit-bias"
        )
        _at_most(
            "allowed_token_ids",
            len(params.allowed_token_ids or []),
            self.vocab_size,
            "the vocabulary size",
        )
        for name, words in (("stop", params.stop), ("bad_words", params.bad_words)):
            longest = max((len(w) for w in words), default=0)
            _at_most(name, longest, limits.max_stop_length, "--max-stop-length", "characters long")

    def _check_beam(self, params: BeamSearchParams, prompt_len: int) -> None:
        """A beam search runs its beams in lockstep: all must fit in one step's token budget
        and, unshared, in the KV cache, or the search could never finish."""
        _at_most("beam_width", params.beam_width, self.limits.max_n, "--max-n")
        _at_most("beam_width", params.beam_width, self.max_num_seqs, "--max-num-seqs")
        _at_most(
            "beam_width", params.beam_width, self.max_num_batched_tokens, "max_num_batched_tokens"
        )
        candidates = BeamSearch(params, frozenset(self.eos_token_ids), 1).num_candidates
        _at_most("beam_width", candidates, self.vocab_size, "the vocabulary size", "candidates")
        longest = min(prompt_len + params.max_tokens, self.max_model_len)
        blocks = params.beam_width * -(-longest // self.block_size)
        if blocks > self.num_kv_blocks:
            raise RequestError(
                f"beam_width: {plural(params.beam_width, 'beam')} of up to "
                f"{plural(longest, 'token')} would need {blocks} KV blocks and the cache has "
                f"{self.num_kv_blocks}; lower beam_width or max_tokens",
                "beam_width",
            )

    def _beam_step_params(self, params: BeamSearchParams) -> SamplingParams:
        """A beam search steps each beam greedily, reporting the top logprobs it ranks."""
        width = BeamSearch(params, frozenset(self.eos_token_ids), 1).num_candidates
        step = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=width)
        return step.bind(self.tokenizer, self.eos_token_ids, self.vocab_size)


def _at_most(param: str, value: int, limit: int, source: str, what: str = "") -> None:
    if value > limit:
        unit = f" {what}" if what else ""
        raise RequestError(
            f"{param}: at most {limit}{unit} (set by {source}), got {value}{unit}", param
        )


def _token_ids(value: object) -> list[int]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise RequestError("prompt: must be a string or a list of integer token ids", "prompt")
    return list(value)
