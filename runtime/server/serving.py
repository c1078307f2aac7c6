"""The generation endpoints: OpenAI requests in, engine streams through, OpenAI bodies out.

Every request runs in the engine as ``DELTA`` outputs, streamed or not, so the server sees
each step's tokens as they come (for inter-token latency), and one rendering path
(``rendering.py``) turns them into chunks or, joined, into a body.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ladle.logs import request_id_var
from ladle.runtime.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from ladle.runtime.errors import RequestError, require_text
from ladle.runtime.filters import FilterRequest, Rejected
from ladle.runtime.filters.stream import FilteredText
from ladle.runtime.outputs import PromptLogprobs, RequestOutput
from ladle.runtime.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from ladle.runtime.server import rendering
from ladle.runtime.server.audit import AuditEntry
from ladle.runtime.server.errors import APIError, error_body, from_validation_errors
from ladle.runtime.server.lifecycle import ServerState
from ladle.runtime.server.metrics import RequestRecord
from ladle.runtime.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    UsageInfo,
    _GenerationRequest,
)
from ladle.runtime.server.rendering import ChoiceState, Echo, Shown
from ladle.runtime.server.streaming import (
    DONE,
    ClientDisconnected,
    SSEResponse,
    merge,
    sse,
    until_disconnect,
)
from ladle.words import plural

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
        "timeout",
    }
)
# Accepted for client compatibility; they do not change what is generated.
_IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
# The completions API's default length (chat's is "until the context is full").
_COMPLETIONS_MAX_TOKENS = 16


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


# A choice's key: (prompt index, choice index within the prompt).
_Key = tuple[int, int]


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
        priority: int,
    ) -> _Prompt:
        """Tokenize and validate now, so that a bad prompt is a 400 before any stream starts."""
        engine = llm.engine
        checked = engine.process_inputs(request_id, prompt, params, priority=priority)
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
        if not isinstance(rendered, str):
            raise RequestError("chat_template_kwargs: the template must render text", "messages")
        require_text(rendered, "messages")
        return rendered, list(tokenizer.encode(rendered, add_special_tokens=False))

    def _deadline(self, request: _GenerationRequest, raw: Request, arrival: float) -> float | None:
        """Seconds from arrival: the body's ``timeout`` or the gateway's ``x-ladle-timeout``
        header (the shorter, when both are sent), else the server's --request-timeout."""
        given = [t for t in (request.timeout, _header_timeout(raw)) if t is not None]
        timeout = min(given) if given else self.state.settings.request_timeout
        return None if timeout is None else arrival + timeout

    async def _run(
        self,
        llm: AsyncLLM,
        record: RequestRecord,
        prompt: _Prompt,
        params: SamplingParams | BeamSearchParams,
        priority: int,
        deadline: float | None,
        audit: AuditEntry | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One engine request; however it ends, its record is finished, counted and logged."""
        metrics = self.state.metrics
        self.state.engine_request_started(record.engine_request_id, record.num_seqs)
        inputs = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
        try:
            stream = llm.generate(inputs, params, record.engine_request_id, priority, deadline)
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
            if audit is not None:
                audit.engine_request(record)

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
        deadline = self._deadline(request, raw, arrival)
        if deadline is not None:
            public["timeout"] = round(deadline - arrival, 3)
        width = _width(params)
        audit = _audit(raw)
        if audit is not None:
            model = llm.engine.served_model_name
            audit.begin(model, public, request.stream, [p.text for p in prompts])
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
                num_seqs=width,
            )
            streams.append(
                self._run(llm, record, prompt, params, request.priority, deadline, audit)
            )
        return streams

    @staticmethod
    def _include_usage(request: _GenerationRequest) -> bool:
        return request.stream_options is not None and request.stream_options.include_usage

    @staticmethod
    def _usage(prompts: list[_Prompt], choices: dict[_Key, ChoiceState]) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        completion_tokens = sum(c.num_tokens for c in choices.values())
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
        except RequestFailedError:
            raise _request_failed(raw.state.request_id) from None
        return JSONResponse(result.model_dump(mode="json"))

    async def _shown(
        self,
        streams: list[AsyncGenerator[RequestOutput, None]],
        choices: dict[_Key, ChoiceState],
        new_choice: Callable[[_Key], ChoiceState],
        stream: bool,
        audit: AuditEntry | None,
        on_filter_stop: Callable[[int], None],
    ) -> AsyncIterator[list[tuple[_Key, Shown]]]:
        """The one path from engine deltas to what a response shows: streamed, whatever each
        output makes showable; otherwise, everything at once when all streams are done."""
        parts = self._shown_parts(streams, choices, new_choice, stream, on_filter_stop)
        async with contextlib.aclosing(parts):
            async for batch in parts:
                if audit is not None:
                    for _, part in batch:
                        audit.shown(part.index, part.text)
                yield batch
        if audit is not None:
            filtered = (c.filtered for c in choices.values() if c.filtered is not None)
            audit.filtered = sorted({name for f in filtered for name in f.changed_by})

    async def _shown_parts(
        self,
        streams: list[AsyncGenerator[RequestOutput, None]],
        choices: dict[_Key, ChoiceState],
        new_choice: Callable[[_Key], ChoiceState],
        stream: bool,
        on_filter_stop: Callable[[int], None],
    ) -> AsyncGenerator[list[tuple[_Key, Shown]], None]:
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        async for i, output in merge(streams):
            if output.prompt_logprobs is not None:
                prompt_logprobs[i] = output.prompt_logprobs
            ready = []
            for completion in output.outputs:
                key = (i, completion.index)
                choice = choices.get(key)
                if choice is None:
                    choice = choices[key] = new_choice(key)
                stopped = choice.stopped_by_filter
                choice.add(completion)
                if choice.stopped_by_filter and not stopped:
                    on_filter_stop(i)
                if stream and choice.ready:
                    ready.append((key, choice.take(prompt_logprobs.get(i))))
            if ready:
                yield ready
        if not stream:
            yield [(k, c.take(prompt_logprobs.get(k[0]))) for k, c in sorted(choices.items())]

    def _filtered(self) -> FilteredText | None:
        """A choice's own chain of output filters (they hold its text back), if any."""
        filters = self.state.output_filters
        return FilteredText(filters) if filters else None

    @staticmethod
    def _stopper(
        llm: AsyncLLM, response_id: str, choices: dict[_Key, ChoiceState], width: int
    ) -> Callable[[int], None]:
        """Once output filters have stopped every choice of a prompt, its engine request
        stops too: nothing more of it would be shown."""

        def stopped(prompt: int) -> None:
            mine = [c for k, c in choices.items() if k[0] == prompt]
            if len(mine) == width and all(c.stopped_by_filter for c in mine):
                llm.abort(f"{response_id}-{prompt}")

        return stopped

    def _check_input(
        self,
        raw: Request,
        llm: AsyncLLM,
        endpoint: str,
        prompts: list[str],
        messages: list[dict[str, Any]] | None,
        params: SamplingParams | BeamSearchParams,
    ) -> None:
        """Input filters judge the prompts as the model will read them, before admission."""
        if not self.state.input_filters:
            return
        request = FilterRequest(
            endpoint=endpoint,
            model=llm.engine.served_model_name,
            prompts=prompts,
            messages=messages,
            params=_public_params(params),
            request_id=raw.state.request_id,
        )
        for f in self.state.input_filters:
            try:
                f.check(request)
            except Rejected as exc:
                raise APIError(
                    400,
                    f"the request was refused by the input filter {f.name!r}: {exc.reason}",
                    code="content_filter",
                    param=exc.param,
                ) from None

    def _decoder(self, llm: AsyncLLM) -> Callable[[int], str]:
        tokenizer = llm.engine.tokenizer
        return lambda token_id: decode(tokenizer, [token_id])

    # -- /v1/completions ----------------------------------------------------------------

    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        llm = self.state.engine()
        self.check_model(llm, request.model)
        if request.suffix:
            raise RequestError("suffix: not supported by this server", "suffix")
        texts_or_ids = _completion_prompts(request.prompt, llm.engine.limits.max_prompts)
        # OpenAI's echo with max_tokens 0 scores the prompt alone; one token still runs it.
        echo_only = request.echo and request.max_tokens == 0
        params: SamplingParams | BeamSearchParams
        if _beam_search(request):
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
            self._prepare(llm, f"{response_id}-{i}", p, params, request.priority)
            for i, p in enumerate(texts_or_ids)
        ]
        texts = [
            p.text if p.text is not None else decode(llm.engine.tokenizer, p.token_ids)
            for p in prompts
        ]
        self._check_input(raw, llm, "/v1/completions", texts, None, params)
        self.state.admit(llm, len(prompts) * _width(params))
        streams = self._streams(
            llm, raw, "/v1/completions", response_id, prompts, params, request, arrival
        )
        model = llm.engine.served_model_name
        tokenizer = llm.engine.tokenizer
        want_logprobs = request.logprobs is not None and isinstance(params, SamplingParams)

        def new_choice(key: _Key) -> ChoiceState:
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

        choices: dict[_Key, ChoiceState] = {}
        stop = self._stopper(llm, response_id, choices, _width(params))
        shown = self._shown(streams, choices, new_choice, request.stream, _audit(raw), stop)
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
        prompts: list[_Prompt],
        shown: AsyncIterator[list[tuple[_Key, Shown]]],
        choices: dict[_Key, ChoiceState],
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
            yield _stream_error(exc)
        yield DONE

    async def _completion_body(
        self,
        llm: AsyncLLM,
        response_id: str,
        model: str,
        prompts: list[_Prompt],
        shown: AsyncIterator[list[tuple[_Key, Shown]]],
        choices: dict[_Key, ChoiceState],
    ) -> CompletionResponse:
        result = [
            self._completion_choice(llm, choices[key], part)
            async for batch in shown
            for key, part in batch
        ]
        return CompletionResponse(
            id=response_id, model=model, choices=result, usage=self._usage(prompts, choices)
        )

    # -- /v1/chat/completions -----------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        llm = self.state.engine()
        self.check_model(llm, request.model)
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
        prompt = _Prompt(
            text, self._prepare(llm, response_id, ids, params, request.priority).token_ids
        )
        messages = [m.for_template() for m in request.messages]
        self._check_input(raw, llm, "/v1/chat/completions", [text], messages, params)
        self.state.admit(llm, _width(params))
        streams = self._streams(
            llm, raw, "/v1/chat/completions", response_id, [prompt], params, request, arrival
        )
        model = llm.engine.served_model_name
        want_logprobs = request.logprobs and isinstance(params, SamplingParams)

        def new_choice(key: _Key) -> ChoiceState:
            return ChoiceState(key[1], bool(want_logprobs), filtered=self._filtered())

        choices: dict[_Key, ChoiceState] = {}
        stop = self._stopper(llm, response_id, choices, _width(params))
        shown = self._shown(streams, choices, new_choice, request.stream, _audit(raw), stop)
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
        prompt: _Prompt,
        shown: AsyncIterator[list[tuple[_Key, Shown]]],
        choices: dict[_Key, ChoiceState],
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
            yield _stream_error(exc)
        yield DONE

    async def _chat_body(
        self,
        llm: AsyncLLM,
        response_id: str,
        model: str,
        prompt: _Prompt,
        shown: AsyncIterator[list[tuple[_Key, Shown]]],
        choices: dict[_Key, ChoiceState],
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


def _audit(raw: Request) -> AuditEntry | None:
    """The request's audit entry, when the audit trail is on."""
    entry = getattr(raw.state, "audit", None)
    return entry if isinstance(entry, AuditEntry) else None


def _beam_search(request: _GenerationRequest) -> bool:
    return bool((request.model_extra or {}).get("use_beam_search", False))


def _width(params: SamplingParams | BeamSearchParams) -> int:
    """Sequences one prompt runs: its n or best_of samples, or its beams."""
    return params.beam_width if isinstance(params, BeamSearchParams) else params.num_samples


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


def _header_timeout(raw: Request) -> float | None:
    header = raw.headers.get("x-ladle-timeout")
    if header is None:
        return None
    try:
        seconds = float(header)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < math.inf:
        raise RequestError(
            f"x-ladle-timeout: must be a positive number of seconds, got {header!r}",
            "x-ladle-timeout",
        )
    return seconds


def _request_failed(request_id: str) -> APIError:
    return APIError(
        500,
        f"the request failed inside the engine (request id {request_id}); the server goes on",
        code="request_failed",
    )


def _stream_error(exc: Exception) -> str:
    """Once a stream has started, errors travel as an event; the status is already 200."""
    if isinstance(exc, RequestError):
        body = error_body(400, str(exc), "invalid_parameter", exc.param)
    elif isinstance(exc, EngineDeadError):
        body = error_body(503, str(exc), "engine_dead")
    elif isinstance(exc, RequestFailedError):
        failed = _request_failed(request_id_var.get() or "unknown")
        body = error_body(500, failed.message, failed.code)
    else:
        log.exception("error while streaming")
        body = error_body(500, "internal server error while streaming", "internal_error")
    return sse(body)


def decode(tokenizer: Any, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text
