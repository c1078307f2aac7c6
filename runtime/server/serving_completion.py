"""/v1/completions: the four prompt shapes, echo, logprobs and suffix, as OpenAI shapes them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ladle.runtime.async_engine import AsyncLLM
from ladle.runtime.errors import RequestError
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams
from ladle.runtime.server import rendering
from ladle.runtime.server.params import (
    build_beam_params,
    build_sampling_params,
    seqs_per_prompt,
    wants_beam_search,
)
from ladle.runtime.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)
from ladle.runtime.server.rendering import ChoiceState, Echo, Shown
from ladle.runtime.server.serving_engine import (
    Key,
    OpenAIServing,
    Prompt,
    audit_of,
    decode,
    stream_error,
)
from ladle.runtime.server.streaming import (
    DONE,
    SSEResponse,
    sse,
)
from ladle.words import plural

# The completions API's default length (chat's is "until the context is full").
_COMPLETIONS_MAX_TOKENS = 16


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        llm = self.state.engine()
        target = self.state.adapters.resolve(llm, request.model)
        if request.suffix:
            raise RequestError("suffix: not supported by this server", "suffix")
        texts_or_ids = _completion_prompts(request.prompt, llm.engine.limits.max_prompts)
        # OpenAI's echo with max_tokens 0 scores the prompt alone; one token still runs it.
        echo_only = request.echo and request.max_tokens == 0
        params: SamplingParams | BeamSearchParams
        if wants_beam_search(request):
            max_tokens = 1 if echo_only else request.max_tokens
            params = build_beam_params(request, max_tokens, _COMPLETIONS_MAX_TOKENS)
        else:
            overrides: dict[str, Any] = {}
            if request.logprobs is not None:
                overrides["logprobs"] = request.logprobs
                if request.echo and "prompt_logprobs" not in (request.model_extra or {}):
                    # vLLM's rule: echoed prompt tokens get the same number of top logprobs.
                    overrides["prompt_logprobs"] = request.logprobs
            if echo_only:
                overrides["max_tokens"] = 1
            params = build_sampling_params(request, overrides)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = [
            self._prepare(llm, f"{response_id}-{i}", p, params, request.priority, target)
            for i, p in enumerate(texts_or_ids)
        ]
        texts = [
            p.text if p.text is not None else decode(llm.engine.tokenizer, p.token_ids)
            for p in prompts
        ]
        self._check_input(raw, target, "/v1/completions", texts, None, params)
        self.state.admit(llm, len(prompts) * seqs_per_prompt(params))
        streams = self._streams(
            llm, raw, "/v1/completions", response_id, prompts, params, request, arrival, target
        )
        model = target.name
        tokenizer = llm.engine.tokenizer
        want_logprobs = request.logprobs is not None and isinstance(params, SamplingParams)

        def new_choice(key: Key) -> ChoiceState:
            prompt = prompts[key[0]]
            echo = None
            if request.echo:
                text = prompt.text
                if text is None:
                    text = decode(tokenizer, prompt.token_ids, skip_special_tokens=False)
                echo = Echo(text, prompt.token_ids)
            return ChoiceState(
                key[0] * request.n + key[1],
                want_logprobs,
                echo,
                drop_generated=echo_only,
                filtered=self._filtered(),
            )

        choices: dict[Key, ChoiceState] = {}
        stop = self._stopper(llm, response_id, choices, seqs_per_prompt(params))
        shown = self._shown(streams, choices, new_choice, request.stream, audit_of(raw), stop)
        if request.stream:
            return SSEResponse(
                self._completion_events(llm, request, response_id, model, prompts, shown, choices)
            )
        return await self._respond(
            raw, self._completion_body(llm, response_id, model, prompts, shown, choices)
        )

    def _completion_choice(
        self, llm: AsyncLLM, choice: ChoiceState, shown: Shown
    ) -> CompletionChoice:
        logprobs = None
        if shown.logprobs is not None:
            logprobs = rendering.completion_logprobs(choice, shown, self._decoder(llm))
        return CompletionChoice(
            index=shown.index,
            text=shown.text,
            logprobs=logprobs,
            finish_reason=shown.finish_reason,
            stop_reason=shown.stop_reason,
            prompt_logprobs=rendering.prompt_logprobs(shown.prompt_logprobs),
        )

    async def _completion_events(
        self,
        llm: AsyncLLM,
        request: CompletionRequest,
        response_id: str,
        model: str,
        prompts: list[Prompt],
        shown: AsyncIterator[list[tuple[Key, Shown]]],
        choices: dict[Key, ChoiceState],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        try:
            async for batch in shown:
                for key, part in batch:
                    chunk = CompletionResponse(
                        id=response_id,
                        created=created,
                        model=model,
                        choices=[self._completion_choice(llm, choices[key], part)],
                    )
                    yield sse(chunk)
            if self._include_usage(request):
                usage = self._usage(prompts, choices)
                yield sse(
                    CompletionResponse(
                        id=response_id, created=created, model=model, choices=[], usage=usage
                    )
                )
        except Exception as exc:
            yield stream_error(exc)
        yield DONE

    async def _completion_body(
        self,
        llm: AsyncLLM,
        response_id: str,
        model: str,
        prompts: list[Prompt],
        shown: AsyncIterator[list[tuple[Key, Shown]]],
        choices: dict[Key, ChoiceState],
    ) -> CompletionResponse:
        result = [
            self._completion_choice(llm, choices[key], part)
            async for batch in shown
            for key, part in batch
        ]
        return CompletionResponse(
            id=response_id, model=model, choices=result, usage=self._usage(prompts, choices)
        )


def _completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]], limit: int
) -> list[Any]:
    """The API's four prompt shapes as a list of prompts (text, or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt: must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    if len(prompt) > limit:
        raise RequestError(
            f"prompt: at most {plural(limit, 'prompt')} per request (set by --max-prompts), "
            f"got {len(prompt)}",
            "prompt",
        )
    return list(prompt)
