"""The FastAPI application: routes, middleware and error handlers around one ``ServerState``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ladle import __version__
from ladle.runtime.async_engine import AsyncLLM
from ladle.runtime.errors import RequestError, require_text
from ladle.runtime.profiler import EngineProfiler, ProfilerStateError, export
from ladle.runtime.server.chat_template import render_chat
from ladle.runtime.server.errors import APIError, install_handlers
from ladle.runtime.server.lifecycle import ServerState
from ladle.runtime.server.middleware import ServerMiddleware
from ladle.runtime.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    ProfileResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
    VersionResponse,
)
from ladle.runtime.server.serving_chat import OpenAIServingChat
from ladle.runtime.server.serving_completion import OpenAIServingCompletion
from ladle.runtime.server.serving_engine import decode

log = logging.getLogger("ladle.server")
T = TypeVar("T")


def _health(reason: str | None) -> JSONResponse:
    if reason is None:
        return JSONResponse(HealthResponse(status="ok").model_dump())
    return JSONResponse(HealthResponse(status=reason).model_dump(), status_code=503)


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        starting = asyncio.ensure_future(state.start())
        yield
        starting.cancel()
        state.shutdown()

    app = FastAPI(title="Ladle", version=__version__, lifespan=lifespan)
    app.add_middleware(ServerMiddleware, state=state)
    install_handlers(app)
    completion = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)

    def loaded() -> AsyncLLM:
        """Endpoints that need only the tokenizer still wait for the model to load."""
        if state.llm is None:
            raise APIError(503, "the model is still loading", code="not_ready")
        return state.llm

    @app.post("/v1/completions", response_model=None)
    async def completions(request: CompletionRequest, raw: Request) -> Response:
        return await completion.create_completion(request, raw)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(request, raw)

    @app.get("/v1/models")
    async def models() -> ModelList:
        """The base model, then each adapter with the base model as its ``parent``."""
        engine = loaded().engine
        base = engine.served_model_name
        cards = [
            ModelCard(id=base, root=str(engine.model_path), max_model_len=engine.max_model_len)
        ]
        for name in state.adapters.names:
            adapter = state.adapters.get(name)
            assert adapter is not None
            cards.append(
                ModelCard(
                    id=name,
                    root=adapter.lora_path,
                    parent=base,
                    max_model_len=engine.max_model_len,
                )
            )
        return ModelList(data=cards)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """vLLM's endpoint: serve an adapter under a new model name, no restart."""
        await state.adapters.load(loaded(), request.lora_name, request.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{request.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        await state.adapters.unload(loaded(), request.lora_name)
        return PlainTextResponse(
            f"Success: LoRA adapter '{request.lora_name}' removed successfully."
        )

    @app.get("/v1/lora_adapters")
    async def lora_adapters() -> dict[str, list[dict[str, str]]]:
        loaded()
        return state.adapters.report()

    @app.post("/tokenize")
    async def tokenize(
        request: TokenizeCompletionRequest | TokenizeChatRequest,
    ) -> TokenizeResponse:
        llm = loaded()
        state.adapters.resolve(llm, request.model)
        tokenizer = llm.engine.tokenizer
        if isinstance(request, TokenizeChatRequest):
            _, ids = render_chat(
                tokenizer,
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
            )
        else:
            prompt = require_text(request.prompt, "prompt")
            ids = list(tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens))
        strs = list(tokenizer.convert_ids_to_tokens(ids)) if request.return_token_strs else None
        return TokenizeResponse(
            count=len(ids), max_model_len=llm.engine.max_model_len, tokens=ids, token_strs=strs
        )

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        llm = loaded()
        state.adapters.resolve(llm, request.model)
        vocab = llm.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in request.tokens):
            raise RequestError(f"tokens: ids must be in [0, {vocab})", "tokens")
        return DetokenizeResponse(prompt=decode(llm.engine.tokenizer, request.tokens))

    @app.post("/start_profile")
    async def start_profile() -> ProfileResponse:
        """vLLM's endpoint: profile the engine's steps until /stop_profile."""
        profiler = enabled_profiler()
        llm = loaded()
        session = await engine_call(llm, profiler.start)
        state.keep(asyncio.create_task(stop_at_cap(llm, profiler, session)))
        log.info(
            "profiler started",
            extra={"trace_dir": str(profiler.trace_dir), "max_seconds": profiler.max_seconds},
        )
        return ProfileResponse(status="started")

    async def stop_at_cap(llm: AsyncLLM, profiler: EngineProfiler, session: int) -> None:
        """--profile-max-seconds: the profile stops itself and writes its trace."""
        await asyncio.sleep(profiler.max_seconds)
        try:
            stopped = await engine_call(llm, lambda: profiler.stop_session(session))
        except Exception as exc:  # a hung or dead engine: the probes deal with that
            log.warning("the capped profile could not be stopped", extra={"error": str(exc)})
            return
        if stopped is None:
            return  # /stop_profile came first
        prof, path = stopped
        profiler.capped = path  # named to a /stop_profile that comes while it is written
        trace = await asyncio.to_thread(export, prof, path)
        log.warning(
            "profiler stopped at --profile-max-seconds; trace written",
            extra={"trace": str(trace), "max_seconds": profiler.max_seconds},
        )

    @app.post("/stop_profile")
    async def stop_profile() -> ProfileResponse:
        profiler = enabled_profiler()
        prof, path = await engine_call(loaded(), profiler.stop)
        trace = await asyncio.to_thread(export, prof, path)
        log.info("profiler trace written", extra={"trace": str(trace)})
        return ProfileResponse(status="stopped", trace=str(trace))

    def enabled_profiler() -> EngineProfiler:
        if state.profiler is None:
            raise APIError(
                404,
                "profiling is off; start the server with --profile-dir DIR to turn it on",
                code="profiling_disabled",
            )
        return state.profiler

    async def engine_call(llm: AsyncLLM, function: Callable[[], T]) -> T:
        """A profiler state mistake is the client's (409); a hung engine is bounded."""
        try:
            return await asyncio.wait_for(llm.call(function), state.settings.liveness_timeout)
        except ProfilerStateError as exc:
            raise APIError(409, str(exc), code="profiler_state") from None
        except TimeoutError:
            raise APIError(503, "the engine did not answer in time", code="engine_busy") from None

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/health/live", response_model=None)
    async def live() -> JSONResponse:
        """Restart me: the engine loop died or hangs. Loading still counts as alive."""
        return _health(state.liveness())

    app.add_api_route("/health", live, methods=["GET"], response_model=None)

    @app.get("/health/ready", response_model=None)
    async def ready() -> JSONResponse:
        """Send me traffic: loaded, warmed up, not draining."""
        return _health(state.readiness())

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    return app
