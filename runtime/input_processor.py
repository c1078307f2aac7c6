"""Requests in: tokenize the prompt, check it and the parameters against the model and the
engine, and hand the scheduler a :class:`Request` that cannot fail later for its own reasons."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ladle.runtime.beam_search import BeamSearch
from ladle.runtime.errors import RequestError
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams

PromptInput = str | list[int] | dict[str, Any]
# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20


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
        max_num_batched_tokens: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens

    def process(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        text, ids = self._tokenize(prompt)
        self._check_prompt(ids)
        beam_params = params if isinstance(params, BeamSearchParams) else None
        return Request(
            request_id,
            text,
            ids,
            self._bind_params(params),
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            beam_params,
        )

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
            raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        return None, list(prompt)

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
        needed = -(-(len(ids) + 1) // self.block_size)
        if needed > self.num_kv_blocks:
            raise RequestError(
                f"the prompt needs {needed} KV blocks but the cache has "
                f"{self.num_kv_blocks}; raise the KV cache memory",
                "prompt",
            )

    def _bind_params(self, params: SamplingParams | BeamSearchParams) -> SamplingParams:
        """Check the request's token ids against the model and add the tokenizer's data. A beam
        search steps each beam greedily, reporting the top logprobs the search ranks."""
        if isinstance(params, BeamSearchParams):
            # All beams must fit in one step, or the last ones would never run with the others.
            if params.beam_width > self.max_num_batched_tokens:
                raise RequestError(
                    f"beam_width: must be <= max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}), got {params.beam_width}",
                    "beam_width",
                )
            eos = frozenset(self.eos_token_ids)
            width = BeamSearch(params, eos, params.max_tokens).num_candidates
            params = SamplingParams(
                temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=width
            )
            return params.bind(self.tokenizer, self.eos_token_ids, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise RequestError(f"{name}: must be <= {MAX_LOGPROBS}, got {value}", name)
        return params.bind(self.tokenizer, self.eos_token_ids, self.vocab_size)
