"""/v1/chat/completions: messages through the chat template, and chat's bodies and chunks."""

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
from ladle.runtime.server.chat_template import render_chat
from ladle.runtime.server.params import (
    build_beam_params,
    build_sampling_params,
    seqs_per_prompt,
    wants_beam_search,
)
from ladle.runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from ladle.runtime.server.rendering import ChoiceState, Shown
from ladle.runtime.server.serving_engine import (
    Key,
    OpenAIServing,
    Prompt,
    audit_of,
    stream_error,
)
from ladle.runtime.server.streaming import (
    DONE,
    SSEResponse,
    sse,
)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
        self, request: ChatCompletionRequest, raw: Request
    ) -> Response:
        arrival = time.monotonic()
        llm = self.state.engine()
        target = self.state.adapters.resolve(llm, request.model)
        overrides: dict[str, Any] = {}
        top = request.top_logprobs or 0
        if request.logprobs:
            limit = llm.engine.limits.max_logprobs
            if top > limit:
                raise RequestError(f"top_logprobs: must be <= {limit}, got {top}", "top_logprobs")
            overrides["logprobs"] = top
        elif request.top_logprobs:
            raise RequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
        # Chat's default is "until the context is full", not the completions API's 16.
        max_tokens = (
            request.max_completion_tokens
            if "max_completion_tokens" in request.model_fields_set
            else request.max_tokens
        )
        overrides["max_tokens"] = max_tokens
        text, ids = render_chat(
            llm.engine.tokenizer,
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        params: SamplingParams | BeamSearchParams
        if wants_beam_search(request):
            room = max(1, llm.engine.max_model_len - len(ids))
            params = build_beam_params(request, max_tokens, room)
        else:
            params = build_sampling_params(request, overrides)
        if (
            request.stream
            and isinstance(params, SamplingParams)
            and params.prompt_logprobs is not None
        ):
            raise RequestError("prompt_logprobs: not supported when streaming chat", "stream")
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = Prompt(
            text, self._prepare(llm, response_id, ids, params, request.priority, target).token_ids
        )
        messages = [m.for_template() for m in request.messages]
        self._check_input(raw, target, "/v1/chat/completions", [text], messages, params)
        self.state.admit(llm, seqs_per_prompt(params))
        streams = self._streams(
            llm,
            raw,
            "/v1/chat/completions",
            response_id,
            [prompt],
            params,
            request,
            arrival,
            target,
        )
        model = target.name
        want_logprobs = request.logprobs and isinstance(params, SamplingParams)

        def new_choice(key: Key) -> ChoiceState:
            return ChoiceState(key[1], bool(want_logprobs), filtered=self._filtered())

        choices: dict[Key, ChoiceState] = {}
        stop = self._stopper(llm, response_id, choices, seqs_per_prompt(params))
        shown = self._shown(streams, choices, new_choice, request.stream, audit_of(raw), stop)
        if request.stream:
            return SSEResponse(
                self._chat_events(llm, request, response_id, model, prompt, shown, choices, top)
            )
        return await self._respond(
            raw, self._chat_body(llm, response_id, model, prompt, shown, choices, top)
        )

    async def _chat_events(
        self,
        llm: AsyncLLM,
        request: ChatCompletionRequest,
        response_id: str,
        model: str,
        prompt: Prompt,
        shown: AsyncIterator[list[tuple[Key, Shown]]],
        choices: dict[Key, ChoiceState],
        top: int,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        decoder = self._decoder(llm)

        def chunk(*items: ChatStreamChoice, usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=response_id, created=created, model=model, choices=list(items), usage=usage
                )
            )

        try:
            for index in range(request.n):
                yield chunk(
                    ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                )
            async for batch in shown:
                for _, part in batch:
                    logprobs = None
                    if part.logprobs is not None:
                        logprobs = rendering.chat_logprobs(part, top, decoder)
                    yield chunk(
                        ChatStreamChoice(
                            index=part.index,
                            delta=DeltaMessage(content=part.text or None),
                            logprobs=logprobs,
                            finish_reason=part.finish_reason,
                            stop_reason=part.stop_reason,
                        )
                    )
            if self._include_usage(request):
                yield chunk(usage=self._usage([prompt], choices))
        except Exception as exc:
            yield stream_error(exc)
        yield DONE

    async def _chat_body(
        self,
        llm: AsyncLLM,
        response_id: str,
        model: str,
        prompt: Prompt,
        shown: AsyncIterator[list[tuple[Key, Shown]]],
        choices: dict[Key, ChoiceState],
        top: int,
    ) -> ChatCompletionResponse:
        decoder = self._decoder(llm)
        result = []
        prompt_logprobs = None
        async for batch in shown:
            for _, part in batch:
                prompt_logprobs = prompt_logprobs or part.prompt_logprobs
                result.append(
                    ChatChoice(
                        index=part.index,
                        message=AssistantMessage(content=part.text),
                        logprobs=None
                        if part.logprobs is None
                        else rendering.chat_logprobs(part, top, decoder),
                        finish_reason=part.finish_reason,
                        stop_reason=part.stop_reason,
                    )
                )
        return ChatCompletionResponse(
            id=response_id,
            model=model,
            choices=result,
            usage=self._usage([prompt], choices),
            prompt_logprobs=rendering.prompt_logprobs(prompt_logprobs),
        )
