"""What both generation endpoints share, facing the engine: tokenize and check each prompt,
admit, run its engine requests (counted, logged, audited however they end), and turn engine
deltas into what a response shows (``rendering``), streamed or joined.

Every request runs in the engine as ``DELTA`` outputs, streamed or not, so the server sees each
step's tokens as they come (for inter-token latency). ``serving_completion`` and
``serving_chat`` each shape one endpoint's bodies.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ladle.logs import request_id_var
from ladle.runtime.async_engine import AsyncLLM, EngineDeadError, RequestFailedError
from ladle.runtime.errors import RequestError
from ladle.runtime.filters import FilterRequest, Rejected
from ladle.runtime.filters.stream import FilteredText
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.outputs import PromptLogprobs, RequestOutput
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams
from ladle.runtime.server.adapters import Target
from ladle.runtime.server.audit import AuditEntry
from ladle.runtime.server.errors import APIError, error_body
from ladle.runtime.server.lifecycle import ServerState
from ladle.runtime.server.metrics import RequestRecord
from ladle.runtime.server.params import public_params, seqs_per_prompt
from ladle.runtime.server.protocol import (
    UsageInfo,
    _GenerationRequest,
)
from ladle.runtime.server.rendering import ChoiceState, Shown

if TYPE_CHECKING:
    from opentelemetry.trace import Span
from ladle.runtime.server.streaming import (
    ClientDisconnected,
    merge,
    sse,
    until_disconnect,
)

log = logging.getLogger("ladle.server.requests")


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


# A choice's key: (prompt index, choice index within the prompt).
Key = tuple[int, int]


class OpenAIServing:
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _prepare(
        self,
        llm: AsyncLLM,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | BeamSearchParams,
        priority: int,
        target: Target,
    ) -> Prompt:
        """Tokenize and validate now, so that a bad prompt is a 400 before any stream starts."""
        engine = llm.engine
        checked = engine.process_inputs(
            request_id, prompt, params, priority=priority, lora_request=target.lora
        )
        ids = checked.prompt_token_ids
        if params.max_tokens is not None and len(ids) + params.max_tokens > engine.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {engine.max_model_len} tokens; the "
                f"prompt has {len(ids)} and max_tokens asks for {params.max_tokens} more",
                "max_tokens",
            )
        return Prompt(checked.prompt, ids)

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
        prompt: Prompt,
        params: SamplingParams | BeamSearchParams,
        priority: int,
        deadline: float | None,
        audit: AuditEntry | None,
        span: Span | None,
        lora: LoRARequest | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """One engine request; however it ends, its record is finished, counted, logged and
        traced."""
        metrics = self.state.metrics
        self.state.engine_request_started(record.engine_request_id, record.num_seqs)
        inputs = {"prompt": prompt.text, "prompt_token_ids": prompt.token_ids}
        try:
            stream = llm.generate(
                inputs, params, record.engine_request_id, priority, deadline, lora
            )
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
            if span is not None:
                self._trace(record, span)
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

    def _trace(self, record: RequestRecord, span: Span) -> None:
        """The engine's phases of one request, under the request's span, from its record's
        timings. Detokenizing is incremental, inside each decode step; ``stream`` is the
        last output's way out, after the last token."""
        tracing = self.state.tracing
        assert tracing is not None
        finished = record.finished if record.finished is not None else time.monotonic()
        engine = tracing.child(
            "engine.request",
            record.arrival,
            span,
            {
                "ladle.request_id": record.request_id,
                "ladle.engine_request_id": record.engine_request_id,
                "gen_ai.usage.input_tokens": record.prompt_tokens,
                "gen_ai.usage.output_tokens": record.completion_tokens,
                "ladle.cached_tokens": record.cached_tokens,
                "ladle.finish_reason": record.finish_reason,
            },
        )
        tracing.record("engine.queue", record.arrival, record.first_scheduled, engine)
        tracing.record(
            "engine.prefill",
            record.first_scheduled,
            record.first_token,
            engine,
            {"gen_ai.usage.input_tokens": record.prompt_tokens},
        )
        tracing.record(
            "engine.decode",
            record.first_token,
            record.last_token,
            engine,
            {"gen_ai.usage.output_tokens": record.completion_tokens},
        )
        tracing.record("stream", record.last_token, finished, engine)
        tracing.end(engine, finished)

    def _streams(
        self,
        llm: AsyncLLM,
        raw: Request,
        endpoint: str,
        response_id: str,
        prompts: list[Prompt],
        params: SamplingParams | BeamSearchParams,
        request: _GenerationRequest,
        arrival: float,
        target: Target,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        request_id: str = raw.state.request_id
        span: Span | None = getattr(raw.state, "span", None)
        public = public_params(params)
        deadline = self._deadline(request, raw, arrival)
        if deadline is not None:
            public["timeout"] = round(deadline - arrival, 3)
        width = seqs_per_prompt(params)
        audit = audit_of(raw)
        if audit is not None:
            audit.begin(target.name, public, request.stream, [p.text for p in prompts])
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
                lora_name=None if target.lora is None else target.lora.lora_name,
            )
            streams.append(
                self._run(
                    llm,
                    record,
                    prompt,
                    params,
                    request.priority,
                    deadline,
                    audit,
                    span,
                    target.lora,
                )
            )
        return streams

    @staticmethod
    def _include_usage(request: _GenerationRequest) -> bool:
        return request.stream_options is not None and request.stream_options.include_usage

    @staticmethod
    def _usage(prompts: list[Prompt], choices: dict[Key, ChoiceState]) -> UsageInfo:
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
        choices: dict[Key, ChoiceState],
        new_choice: Callable[[Key], ChoiceState],
        stream: bool,
        audit: AuditEntry | None,
        on_filter_stop: Callable[[int], None],
    ) -> AsyncIterator[list[tuple[Key, Shown]]]:
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
        choices: dict[Key, ChoiceState],
        new_choice: Callable[[Key], ChoiceState],
        stream: bool,
        on_filter_stop: Callable[[int], None],
    ) -> AsyncGenerator[list[tuple[Key, Shown]], None]:
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
        llm: AsyncLLM, response_id: str, choices: dict[Key, ChoiceState], width: int
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
        target: Target,
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
            model=target.name,
            prompts=prompts,
            messages=messages,
            params=public_params(params),
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


def audit_of(raw: Request) -> AuditEntry | None:
    """The request's audit entry, when the audit trail is on."""
    entry = getattr(raw.state, "audit", None)
    return entry if isinstance(entry, AuditEntry) else None


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


def stream_error(exc: Exception) -> str:
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
