"""The generation endpoints: OpenAI requests in, engine streams through, OpenAI bodies out.

Every request runs in the engine as ``DELTA`` outputs, streamed or not, so the server sees
each step's tokens as they come (for inter-token latency) and a non-streamed body is simply
the deltas joined.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ladle.runtime.async_engine import AsyncLLM, EngineDeadError
from ladle.runtime.errors import RequestError
from ladle.runtime.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from ladle.runtime.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from ladle.runtime.server.errors import APIError, error_body, from_validation_errors
from ladle.runtime.server.lifecycle import ServerState
from ladle.runtime.server.metrics import RequestRecord
from ladle.runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    TopLogprob,
    UsageInfo,
    _GenerationRequest,
)
from ladle.runtime.server.streaming import (
    DONE,
    ClientDisconnected,
    SSEResponse,
    merge,
    sse,
    until_disconnect,
)

log = logging.getLogger("ladle.server.requests")

# Request fields the server consumes itself; every other field must be a SamplingParams field.
_SERVER_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "priority",
        "prompt",
        "echo",
        "suffix",
        "messages",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "use_beam_search",
    }
)
# Accepted for client compatibility; they do not change what is generated.
_IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
# The completions API's default length (chat's is "until the context is full").
_COMPLETIONS_MAX_TOKENS = 16
# JSON cannot carry -inf; OpenAI and vLLM clamp to this.
_MIN_LOGPROB = -9999.0


@functools.cache
def _sampling_adapter() -> TypeAdapter[SamplingParams]:
    return TypeAdapter(SamplingParams)


@functools.cache
def _sampling_fields() -> frozenset[str]:
    """What a client may set: every constructor field except the server's output mode."""
    fields = dataclasses.fields(SamplingParams)
    return frozenset(f.name for f in fields if f.init and f.name != "output_kind")


def build_sampling_params(request: _GenerationRequest, overrides: dict[str, Any]) -> SamplingParams:
    """Map the request's fields onto ``SamplingParams`` by name.

    vLLM's extras arrive as extra body fields and pass through the same way, so a field added
    to ``SamplingParams`` is served with no change here. Unknown fields are refused by name.
    """
    given = {name: getattr(request, name) for name in request.model_fields_set}
    given.update(request.model_extra or {})
    kwargs = {
        k: v
        for k, v in given.items()
        if k not in _SERVER_FIELDS and k not in _IGNORED_FIELDS and v is not None
    }
    kwargs.update(overrides)
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    unknown = sorted(set(kwargs) - _sampling_fields())
    if unknown:
        raise RequestError(f"{unknown[0]}: not supported by this server", unknown[0])
    kwargs["output_kind"] = RequestOutputKind.DELTA
    try:
        return _sampling_adapter().validate_python(kwargs)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


def build_beam_params(
    request: _GenerationRequest, max_tokens: int | None, default_max_tokens: int
) -> BeamSearchParams:
    """vLLM's ``use_beam_search``: ``n`` beams, best first. As in vLLM, the sampling fields
    other than the beam search's own do not apply and are ignored."""
    extra = request.model_extra or {}
    kwargs = {k: extra[k] for k in ("length_penalty", "early_stopping") if k in extra}
    try:
        return _beam_adapter().validate_python(
            {
                "beam_width": request.n,
                "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
                "ignore_eos": extra.get("ignore_eos", False),
                **kwargs,
            }
        )
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


@functools.cache
def _beam_adapter() -> TypeAdapter[BeamSearchParams]:
    return TypeAdapter(BeamSearchParams)


def _public_params(params: SamplingParams | BeamSearchParams) -> dict[str, Any]:
    """The settings that shaped this request, for its log line: temperature and max_tokens
    always, the rest where they differ from the defaults."""
    if isinstance(params, BeamSearchParams):
        return {"use_beam_search": True, **dataclasses.asdict(params)}
    defaults = _default_params()
    return {
        name: getattr(params, name)
        for name in sorted(_sampling_fields())
        if name in ("temperature", "max_tokens") or getattr(params, name) != defaults[name]
    }


@functools.cache
def _default_params() -> dict[str, Any]:
    params = SamplingParams()
    return {name: getattr(params, name) for name in _sampling_fields()}


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class _Choice:
    """One choice as it accumulates across deltas."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0
    started: bool = False

    def add(self, completion: CompletionOutput) -> None:
        self.text.append(completion.text)
        self.token_ids.extend(completion.token_ids)
        if completion.logprobs:
            self.logprobs.extend(completion.logprobs)
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    # -- shared -------------------------------------------------------------------------

    def check_model(self, llm: AsyncLLM, name: str | None) -> None:
        served = llm.engine.served_model_name
        if name is not None and name != served:
            raise APIError(
                400,
                f"the model {name!r} does not exist; this server serves {served!r}",
                code="model_not_found",
                param="model",
            )

    def _prepare(
        self,
        llm: AsyncLLM,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
    ) -> _Prompt:
        """Tokenize and validate now, so that a bad prompt is a 400 before any stream starts."""
        engine = llm.engine
        checked = engine.process_inputs(request_id, prompt, params)
        ids = checked.prompt_token_ids
        if params.max_tokens is not None and len(ids) + params.max_tokens > engine.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {engine.max_model_len} tokens; the "
                f"prompt has {len(ids)} and max_tokens asks for {params.max_tokens} more",
                "max_tokens",
            )
        return _Prompt(checked.prompt, ids)

    def render_chat(
        self,
        llm: AsyncLLM,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        template_kwargs: dict[str, Any] | None,
    ) -> tuple[str, list[int]]:
        """Apply the model's chat template; a template that rejects the messages is a 400."""
        from jinja2 import TemplateError

        tokenizer = llm.engine.tokenizer
        if tokenizer.chat_template is None:
            raise RequestError("this model has no chat template; use /v1/completions", "messages")
        try:
            rendered = tokenizer.apply_chat_template(
                [m.for_template() for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **(template_kwargs or {}),
            )
        except (TemplateError, ValueError, TypeError) as exc:
            raise RequestError(
                f"the chat template rejected the messages: {exc}", "messages"
            ) from None
        text = str(rendered)
        return text, list(tokenizer.encode(text, add_special_tokens=False))

    async def _run(
        self,
        llm: AsyncLLM,
        record: RequestRecord,
        prompt: _Prompt,
        params: SamplingParams | BeamSearchParams,
        priority: int,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One engine request; however it ends, its record is finished, counted and logged."""
        metrics = self.state.metrics
        self.state.engine_request_started(record.engine_request_id)
        inputs = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
        try:
            stream = llm.generate(inputs, params, record.engine_request_id, priority)
            async with contextlib.aclosing(stream) as outputs:
                async for output in outputs:
                    gap = record.on_output(output, time.monotonic())
                    if gap is not None and metrics is not None:
                        metrics.itl.observe(gap)
                    yield output
        except Exception as exc:
            record.error = repr(exc)
            raise
        finally:
            record.finished = time.monotonic()
            self.state.engine_request_finished(record.engine_request_id)
            self._finished(record)

    def _finished(self, record: RequestRecord) -> None:
        if self.state.metrics is not None:
            self.state.metrics.finished(record)
        timings = {k: None if v is None else round(v, 4) for k, v in record.timings().items()}
        extra: dict[str, Any] = {
            "request_id": record.request_id,
            "engine_request_id": record.engine_request_id,
            "endpoint": record.endpoint,
            "stream": record.stream,
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "cached_tokens": record.cached_tokens,
            "finish_reason": record.finish_reason,
            **timings,
            "sampling_params": record.params,
        }
        if record.error is not None:
            extra["error"] = record.error
        if record.prompt is not None:
            extra["prompt"] = record.prompt
        log.info("request finished", extra=extra)

    def _streams(
        self,
        llm: AsyncLLM,
        raw: Request,
        endpoint: str,
        response_id: str,
        prompts: list[_Prompt],
        params: SamplingParams | BeamSearchParams,
        request: _GenerationRequest,
        arrival: float,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        request_id: str = raw.state.request_id
        public = _public_params(params)
        streams = []
        for i, prompt in enumerate(prompts):
            record = RequestRecord(
                request_id=request_id,
                engine_request_id=f"{response_id}-{i}",
                endpoint=endpoint,
                stream=request.stream,
                prompt_tokens=len(prompt.token_ids),
                params=public,
                prompt=prompt.text if self.state.settings.log_prompts else None,
                arrival=arrival,
            )
            streams.append(self._run(llm, record, prompt, params, request.priority))
        return streams

    @staticmethod
    def _include_usage(request: _GenerationRequest) -> bool:
        return request.stream_options is not None and request.stream_options.include_usage

    @staticmethod
    def _usage(prompts: list[_Prompt], completion_tokens: int) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    @staticmethod
    async def _respond(raw: Request, body: Coroutine[Any, Any, BaseModel]) -> Response:
        try:
            result = await until_disconnect(raw, body)
        except ClientDisconnected:
            return Response(status_code=499)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        return JSONResponse(result.model_dump(mode="json"))

    # -- logprobs -----------------------------------------------------------------------

    @staticmethod
    def _token_text(llm: AsyncLLM, token_id: int, entry: Logprob) -> str:
        if entry.decoded_token is not None:
            return entry.decoded_token
        return decode(llm.engine.tokenizer, [token_id])

    def _chat_logprobs(
        self, llm: AsyncLLM, token_ids: list[int], logprobs: list[dict[int, Logprob]], top: int
    ) -> ChatLogprobs:
        content = []
        for token_id, entries in zip(token_ids, logprobs, strict=True):
            ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank))
            alternatives = []
            for alt_id, alt in ranked[:top]:
                text = self._token_text(llm, alt_id, alt)
                alternatives.append(
                    TopLogprob(
                        token=text,
                        logprob=max(alt.logprob, _MIN_LOGPROB),
                        bytes=list(text.encode()),
                    )
                )
            chosen = entries[token_id]
            text = self._token_text(llm, token_id, chosen)
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=max(chosen.logprob, _MIN_LOGPROB),
                    bytes=list(text.encode()),
                    top_logprobs=alternatives,
                )
            )
        return ChatLogprobs(content=content)

    def _completion_logprobs(
        self,
        llm: AsyncLLM,
        choice: _Choice,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]],
    ) -> CompletionLogprobs:
        """OpenAI's legacy shape: the sampled token plus the top ``logprobs`` at each step."""
        result = CompletionLogprobs()
        for token_id, entries in zip(token_ids, logprobs, strict=True):
            text = self._token_text(llm, token_id, entries[token_id])
            result.tokens.append(text)
            result.token_logprobs.append(max(entries[token_id].logprob, _MIN_LOGPROB))
            result.top_logprobs.append(
                {
                    self._token_text(llm, alt_id, alt): max(alt.logprob, _MIN_LOGPROB)
                    for alt_id, alt in entries.items()
                }
            )
            result.text_offset.append(choice.text_offset)
            choice.text_offset += len(text)
        return result

    @staticmethod
    def _prompt_logprobs(prompt_logprobs: PromptLogprobs | None) -> list[Any] | None:
        if prompt_logprobs is None:
            return None
        return [
            None
            if entries is None
            else {
                token_id: PromptLogprob(
                    logprob=max(e.logprob, _MIN_LOGPROB), rank=e.rank, decoded_token=e.decoded_token
                )
                for token_id, e in entries.items()
            }
            for entries in prompt_logprobs
        ]

    # -- /v1/completions ----------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        llm = self.state.admit()
        self.check_model(llm, request.model)
        if request.suffix:
            raise RequestError("suffix: not supported by this server", "suffix")
        params: SamplingParams | BeamSearchParams
        if _beam_search(request):
            max_tokens = request.max_tokens
            params = build_beam_params(request, max_tokens, _COMPLETIONS_MAX_TOKENS)
        else:
            overrides = {} if request.logprobs is None else {"logprobs": request.logprobs}
            params = build_sampling_params(request, overrides)
        if request.echo and request.logprobs is not None:
            raise RequestError("echo: not supported together with logprobs", "echo")
        response_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = [
            self._prepare(llm, f"{response_id}-{i}", p, params)
            for i, p in enumerate(_completion_prompts(request.prompt))
        ]
        streams = self._streams(
            llm, raw, "/v1/completions", response_id, prompts, params, request, arrival
        )
        model = llm.engine.served_model_name
        choices: dict[tuple[int, int], _Choice] = defaultdict(_Choice)
        if request.stream:
            return SSEResponse(
                self._completion_events(llm, request, response_id, model, prompts, streams, choices)
            )
        return await self._respond(
            raw,
            self._completion_body(llm, request, response_id, model, prompts, streams, choices),
        )

    def _completion_choice(
        self,
        llm: AsyncLLM,
        request: CompletionRequest,
        prompts: list[_Prompt],
        choice: _Choice,
        prompt_index: int,
        completion: CompletionOutput,
        prompt_logprobs: PromptLogprobs | None,
    ) -> CompletionChoice:
        text = completion.text
        if request.echo and not choice.started:
            text = (prompts[prompt_index].text or "") + text
        choice.started = True
        logprobs = None
        if request.logprobs is not None and completion.logprobs is not None:
            logprobs = self._completion_logprobs(
                llm, choice, completion.token_ids, completion.logprobs
            )
        return CompletionChoice(
            index=prompt_index * request.n + completion.index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_logprobs=self._prompt_logprobs(prompt_logprobs),
        )

    async def _completion_events(
        self,
        llm: AsyncLLM,
        request: CompletionRequest,
        response_id: str,
        model: str,
        prompts: list[_Prompt],
        streams: list[AsyncGenerator[RequestOutput, None]],
        choices: dict[tuple[int, int], _Choice],
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        completion_tokens = 0
        try:
            async for i, output in merge(streams):
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    choice = choices[(i, completion.index)]
                    if not (completion.text or completion.finish_reason or request.echo):
                        continue
                    chunk = CompletionResponse(
                        id=response_id,
                        created=created,
                        model=model,
                        choices=[
                            self._completion_choice(
                                llm, request, prompts, choice, i, completion, output.prompt_logprobs
                            )
                        ],
                    )
                    yield sse(chunk)
            if self._include_usage(request):
                usage = self._usage(prompts, completion_tokens)
                yield sse(
                    CompletionResponse(
                        id=response_id, created=created, model=model, choices=[], usage=usage
                    )
                )
        except Exception as exc:
            yield _stream_error(exc)
        yield DONE

    async def _completion_body(
        self,
        llm: AsyncLLM,
        request: CompletionRequest,
        response_id: str,
        model: str,
        prompts: list[_Prompt],
        streams: list[AsyncGenerator[RequestOutput, None]],
        choices: dict[tuple[int, int], _Choice],
    ) -> CompletionResponse:
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        async for i, output in merge(streams):
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
            for completion in output.outputs:
                choices[(i, completion.index)].add(completion)
        result = []
        for (i, j), choice in sorted(choices.items()):
            final = CompletionOutput(
                index=j,
                text="".join(choice.text),
                token_ids=choice.token_ids,
                finish_reason=choice.finish_reason,
                stop_reason=choice.stop_reason,
                logprobs=choice.logprobs or None,
            )
            result.append(
                self._completion_choice(
                    llm, request, prompts, _Choice(), i, final, prompt_logprobs.get(i)
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return CompletionResponse(
            id=response_id,
            model=model,
            choices=result,
            usage=self._usage(prompts, completion_tokens),
        )

    # -- /v1/chat/completions -----------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        llm = self.state.admit()
        self.check_model(llm, request.model)
        overrides: dict[str, Any] = {}
        if request.logprobs:
            overrides["logprobs"] = request.top_logprobs or 0
        elif request.top_logprobs:
            raise RequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
        # Chat's default is "until the context is full", not the completions API's 16.
        max_tokens = (
            request.max_completion_tokens
            if "max_completion_tokens" in request.model_fields_set
            else request.max_tokens
        )
        overrides["max_tokens"] = max_tokens
        text, ids = self.render_chat(
            llm,
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template_kwargs,
        )
        params: SamplingParams | BeamSearchParams
        if _beam_search(request):
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
        prompt = _Prompt(text, self._prepare(llm, response_id, ids, params).token_ids)
        streams = self._streams(
            llm, raw, "/v1/chat/completions", response_id, [prompt], params, request, arrival
        )
        model = llm.engine.served_model_name
        choices: dict[int, _Choice] = defaultdict(_Choice)
        top = request.top_logprobs or 0
        if request.stream:
            return SSEResponse(
                self._chat_events(llm, request, response_id, model, prompt, streams, choices, top)
            )
        return await self._respond(
            raw, self._chat_body(llm, request, response_id, model, prompt, streams, choices, top)
        )

    async def _chat_events(
        self,
        llm: AsyncLLM,
        request: ChatCompletionRequest,
        response_id: str,
        model: str,
        prompt: _Prompt,
        streams: list[AsyncGenerator[RequestOutput, None]],
        choices: dict[int, _Choice],
        top: int,
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(*items: ChatStreamChoice, usage: UsageInfo | None = None) -> str:
            return sse(
                ChatCompletionChunk(
                    id=response_id, created=created, model=model, choices=list(items), usage=usage
                )
            )

        completion_tokens = 0
        try:
            for index in range(request.n):
                yield chunk(
                    ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))
                )
            async for _, output in merge(streams):
                for completion in output.outputs:
                    completion_tokens += len(completion.token_ids)
                    if not (completion.text or completion.finish_reason):
                        continue
                    logprobs = None
                    if request.logprobs and completion.logprobs is not None:
                        logprobs = self._chat_logprobs(
                            llm, completion.token_ids, completion.logprobs, top
                        )
                    yield chunk(
                        ChatStreamChoice(
                            index=completion.index,
                            delta=DeltaMessage(content=completion.text or None),
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason,
                            stop_reason=completion.stop_reason,
                        )
                    )
            if self._include_usage(request):
                yield chunk(usage=self._usage([prompt], completion_tokens))
        except Exception as exc:
            yield _stream_error(exc)
        yield DONE

    async def _chat_body(
        self,
        llm: AsyncLLM,
        request: ChatCompletionRequest,
        response_id: str,
        model: str,
        prompt: _Prompt,
        streams: list[AsyncGenerator[RequestOutput, None]],
        choices: dict[int, _Choice],
        top: int,
    ) -> ChatCompletionResponse:
        prompt_logprobs = None
        async for _, output in merge(streams):
            if output.prompt_logprobs is not None:
                prompt_logprobs = output.prompt_logprobs
            for completion in output.outputs:
                choices[completion.index].add(completion)
        result = []
        for index, choice in sorted(choices.items()):
            logprobs = None
            if request.logprobs:
                logprobs = self._chat_logprobs(llm, choice.token_ids, choice.logprobs, top)
            result.append(
                ChatChoice(
                    index=index,
                    message=AssistantMessage(content="".join(choice.text)),
                    logprobs=logprobs,
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
            )
        completion_tokens = sum(len(c.token_ids) for c in choices.values())
        return ChatCompletionResponse(
            id=response_id,
            model=model,
            choices=result,
            usage=self._usage([prompt], completion_tokens),
            prompt_logprobs=self._prompt_logprobs(prompt_logprobs),
        )


def _beam_search(request: _GenerationRequest) -> bool:
    return bool((request.model_extra or {}).get("use_beam_search", False))


def _completion_prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[Any]:
    """The API's four prompt shapes as a list of prompts (text, or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt: must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _stream_error(exc: Exception) -> str:
    """Once a stream has started, errors travel as an event; the status is already 200."""
    if isinstance(exc, RequestError):
        body = error_body(400, str(exc), "invalid_parameter", exc.param)
    elif isinstance(exc, EngineDeadError):
        body = error_body(503, str(exc), "engine_dead")
    else:
        log.exception("error while streaming")
        body = error_body(500, "internal server error while streaming", "internal_error")
    return sse(body)


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    text = tokenizer.decode(token_ids)
    assert isinstance(text, str)
    return text
