"""The engine behind the server: one background thread steps the engine, asyncio streams out.

The engine is not thread-safe, so every change to it (add, abort) is queued to its thread. torch
releases the GIL inside its kernels, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import TypeVar

from ladle.runtime.config import EngineArgs
from ladle.runtime.engine import LLMEngine, PromptInput, Request
from ladle.runtime.limits import RequestLimits
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineDeadError(RuntimeError):
    """The engine loop crashed; no request can complete."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (a bug, not the request's fault); the engine and
    every other request go on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ladle-engine", daemon=True)
        self.error: BaseException | None = None
        # Called from the engine thread once the loop died (after every stream was failed).
        self.on_death: Callable[[BaseException], None] = lambda exc: None
        self.last_heartbeat = time.monotonic()
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, limits: RequestLimits | None = None) -> AsyncLLM:
        return cls(LLMEngine(args, limits))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def seconds_since_heartbeat(self) -> float:
        """How long the loop has been inside one step (or idle-waiting); for liveness probes."""
        return time.monotonic() - self.last_heartbeat

    def seconds_without_progress(self) -> float:
        """How long work has waited without a token computed or sampled (0 while idle): an
        engine that steps but gets nowhere is as dead as one that hangs."""
        return self.engine.seconds_without_progress()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.last_heartbeat = time.monotonic()
                try:
                    # Idle: sleep until a command arrives. Busy: only drain what is queued.
                    busy = self.engine.has_unfinished_requests()
                    command = self._commands.get(block=not busy, timeout=0.5)
                except queue.Empty:
                    command = None
                while command is not None:
                    self._run_command(command)
                    try:
                        command = self._commands.get_nowait()
                    except queue.Empty:
                        command = None
                self.engine.check_health()
                if self.engine.has_unfinished_requests():
                    for output in self.engine.step():
                        self._deliver(output)
        except BaseException as exc:  # the loop must report, not vanish
            log.exception("engine loop died")
            self.error = exc
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"engine loop died: {exc!r}"))
            self._streams.clear()
            self.on_death(exc)

    @staticmethod
    def _run_command(command: Callable[[], None]) -> None:
        """An add or abort that fails is that request's problem, not the loop's."""
        try:
            command()
        except Exception:
            log.exception("an engine command failed")

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        stream.put(output)
        if output.finished:
            del self._streams[output.request_id]

    def _submit(self, command: Callable[[], None]) -> None:
        if self.error is not None:
            raise EngineDeadError(f"engine loop died: {self.error!r}")
        self._commands.put(command)

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        priority: int = 0,
        deadline: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs for one request; leaving the loop early aborts it in the engine. A
        request that fails inside the engine raises :class:`RequestFailedError`."""
        request: Request = self.engine.process_inputs(
            request_id,
            prompt,
            params,
            priority=priority,
            deadline=deadline,
            lora_request=lora_request,
        )
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())

        def add() -> None:
            self._streams[request_id] = stream
            try:
                self.engine.add_request(request_id, request)
            except Exception as exc:
                del self._streams[request_id]
                stream.put(exc)

        self._submit(add)
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailedError(item.error)
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    async def call(self, function: Callable[[], T]) -> T:
        """Run ``function`` on the engine's thread between steps (for what must happen there,
        such as starting the profiler) and return its result or raise its exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(result: T | None, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)  # type: ignore[arg-type]

        def run() -> None:
            try:
                result = function()
            except Exception as exc:
                loop.call_soon_threadsafe(settle, None, exc)
            else:
                loop.call_soon_threadsafe(settle, result, None)

        self._submit(run)
        return await future

    def abort(self, request_id: str) -> None:
        """Stop a request; a consumer still reading gets a final output (finish_reason abort)."""

        def abort() -> None:
            for output in self.engine.abort_request(request_id):
                self._deliver(output)
            self._streams.pop(request_id, None)

        if self.error is None:
            self._commands.put(abort)

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)
        self.engine.shutdown()
