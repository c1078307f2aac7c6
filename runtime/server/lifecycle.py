"""Startup, readiness, admission and drain: what Kubernetes and every request ask the server.

The model loads in the background so that the process answers probes at once: live while
loading, ready only after a warm-up step. On SIGTERM readiness turns 503 and new requests get
503 while the in-flight ones finish, up to the drain timeout; then the rest are aborted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector

from ladle.audit import AuditLog
from ladle.runtime.config import ConfigError, ModelMissing
from ladle.runtime.filters.loader import load_input, load_output
from ladle.runtime.profiler import EngineProfiler
from ladle.runtime.server.adapters import ModulesFileError, ServedAdapters, read_modules_file
from ladle.runtime.server.auth import ApiKeys
from ladle.runtime.server.errors import APIError
from ladle.runtime.server.settings import ServerSettings
from ladle.words import plural

if TYPE_CHECKING:
    from ladle.runtime.async_engine import AsyncLLM
    from ladle.runtime.server.metrics import ServerMetrics
    from ladle.tracing import Tracing

log = logging.getLogger("ladle.server")

# Paths that probes and scrapers (the operator among them) call; they neither count as
# in-flight work nor need a key.
OPEN_PATHS = frozenset(
    {"/health", "/health/live", "/health/ready", "/metrics", "/version", "/v1/lora_adapters"}
)
# How often --lora-modules-file is read for changes (seconds); a ConfigMap's own update takes
# the kubelet up to a minute.
MODULES_FILE_POLL = 2.0
# Aborted requests end after the engine's current step; this bounds that wait.
ABORT_GRACE_SECONDS = 10.0


class ServerState:
    def __init__(self, settings: ServerSettings, load_engine: Callable[[], AsyncLLM]) -> None:
        self.settings = settings
        self.api_keys = ApiKeys(settings.api_keys, settings.api_key_file)
        self.audit = AuditLog(settings.audit_log, "runtime", text=settings.audit_text)
        self.input_filters = load_input(settings.input_filters)
        self.output_filters = load_output(settings.output_filters)
        trace_dir = settings.profile_dir
        self.profiler = (
            None if trace_dir is None else EngineProfiler(trace_dir, settings.profile_max_seconds)
        )
        # Background tasks (a profile's cap): the loop holds only weak references to them.
        self._tasks: set[asyncio.Task[None]] = set()
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.tracing: Tracing | None = None
        if settings.otlp_traces_endpoint is not None:
            from ladle.tracing import start_tracing

            self.tracing = start_tracing(
                "ladle-runtime", settings.otlp_traces_endpoint, settings.trace_sample_ratio
            )
            self.registry.register(self.tracing.dropped_metric("ladle:trace_spans_dropped"))
        self._load_engine = load_engine
        self.adapters = ServedAdapters()
        self.llm: AsyncLLM | None = None
        self.metrics: ServerMetrics | None = None
        self.ready = False
        self.draining = False
        self.exit_code = 0
        # Set by whoever runs the HTTP server: stops it (used when the model fails to load).
        self.request_exit: Callable[[], None] = lambda: None
        self._http_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        # Engine requests in flight, with the sequences each runs.
        self._engine_requests: dict[str, int] = {}

    # -- startup ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model off the event loop, warm it up, then turn ready."""
        from ladle.runtime.server.metrics import ServerMetrics

        try:
            llm = await _in_daemon_thread(self._load_engine)
            await self._load_adapters(llm)
            await self._warm_up(llm)
            metrics = ServerMetrics(self.registry, llm.engine, self.adapters)
        except (ConfigError, APIError) as exc:
            # A setting the engine cannot use, or an adapter it cannot serve: the message says
            # which; no traceback. A setting is refused with EX_CONFIG, which no restart can
            # change (the operator scales such a template to zero instead of crash-looping it);
            # a model or an adapter may yet appear on its volume.
            log.error("the engine failed to start", extra={"error": str(exc)})
            settled = isinstance(exc, ConfigError) and not isinstance(exc, ModelMissing)
            self.exit_code = os.EX_CONFIG if settled else 2
            self.request_exit()
            return
        except Exception:
            log.exception("the engine failed to start")
            self.exit_code = 1
            self.request_exit()
            return
        self.llm = llm
        self.metrics = metrics
        self.ready = True
        loop = asyncio.get_running_loop()

        def died(exc: BaseException) -> None:
            loop.call_soon_threadsafe(self._engine_died, exc)

        llm.on_death = died
        if llm.error is not None:  # died before it could say so
            self._engine_died(llm.error)
            return
        s = self.settings
        # Loaded with the engine already; the thread count is what OMP_NUM_THREADS decided.
        import torch

        log.info(
            "ready",
            extra={
                "url": f"http://{s.host}:{s.port}/v1",
                "model": llm.engine.served_model_name,
                "threads": torch.get_num_threads(),
            },
        )

    def _engine_died(self, exc: BaseException) -> None:
        """No request can complete any more: exit now (as vLLM's server does), so that the
        container restarts at once instead of after the liveness probe's failures. Open
        requests have been answered 503 ``engine_dead`` already."""
        log.error("the engine loop died; exiting so that the replica restarts",
                  extra={"error": repr(exc)})  # fmt: skip
        self.exit_code = 1
        self.request_exit()

    async def _load_adapters(self, llm: AsyncLLM) -> None:
        """--lora-modules, each read and checked before the server turns ready (one it
        cannot serve stops it); then --lora-modules-file's, whose failures are reported while
        the rest serve, and which is watched from then on."""
        modules, file = self.settings.lora_modules, self.settings.lora_modules_file
        for flag, given in (("--lora-modules", modules), ("--lora-modules-file", file)):
            if given and llm.engine.lora is None:
                raise ConfigError(f"{flag} needs --enable-lora")
        for name, path in modules:
            await self.adapters.load(llm, name, path)
        if file is None:
            return
        seen = file.read_text()
        try:
            wanted = read_modules_file(file)
        except ModulesFileError as exc:
            raise ConfigError(str(exc)) from None
        await self.adapters.sync(llm, wanted)
        self.keep(asyncio.create_task(self.adapters.watch(llm, file, seen, MODULES_FILE_POLL)))

    @staticmethod
    async def _warm_up(llm: AsyncLLM) -> None:
        from ladle.runtime.sampling_params import SamplingParams

        started = time.monotonic()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        async for _ in llm.generate("Hello", params, "warmup"):
            pass
        log.info("warm-up step done", extra={"seconds": round(time.monotonic() - started, 3)})

    def keep(self, task: asyncio.Task[None]) -> None:
        """Hold ``task`` until it ends."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.llm is not None:
            self.llm.shutdown()
        if self.tracing is not None:
            self.tracing.close()
        self.audit.close()

    # -- probes -------------------------------------------------------------------------

    def liveness(self) -> str | None:
        """Why the process should be restarted, or None while it is healthy: the engine loop
        died, hangs inside one step, or steps without getting anywhere while work waits (a
        watchdog on progress: tokens computed or sampled, requests finished)."""
        llm = self.llm
        if llm is None:
            return None  # still loading; the startup probe owns this phase
        if not llm.is_running:
            return f"the engine loop stopped: {llm.error!r}"
        timeout = self.settings.liveness_timeout
        stuck = llm.seconds_since_heartbeat()
        if stuck > timeout:
            return f"the engine loop has been inside one step for {stuck:.0f} s"
        idle = llm.seconds_without_progress()
        if idle > timeout:
            waiting = llm.engine.num_unfinished_requests
            open_ = plural(waiting, "request")
            return f"the engine has made no progress for {idle:.0f} s with {open_} open"
        return None

    def readiness(self) -> str | None:
        """Why traffic should not be sent here now, or None when it may."""
        if self.draining:
            return "draining"
        if not self.ready:
            return "loading"
        return self.liveness()

    # -- admission ----------------------------------------------------------------------

    def engine(self) -> AsyncLLM:
        """The engine, if generation requests are taken now; otherwise the 503 to send."""
        if self.draining:
            self._reject("draining")
            raise APIError(
                503,
                "the server is shutting down; retry on another replica",
                code="draining",
                headers={"Connection": "close"},
            )
        llm = self.llm
        if llm is None or not self.ready:
            raise APIError(503, "the model is still loading", code="not_ready")
        if not llm.is_running:
            self._reject("engine_dead")
            raise APIError(
                503, "the engine has stopped; this replica will restart", code="engine_dead"
            )
        return llm

    def admit(self, llm: AsyncLLM, num_seqs: int) -> None:
        """Backpressure, counted in sequences: a request whose ``num_seqs`` would take the
        waiting sequences past --max-waiting-requests gets 429, and one that could never fit
        gets 400."""
        limit = self.settings.max_waiting_requests
        if limit is None:
            return
        if num_seqs > limit:
            raise APIError(
                400,
                f"this request runs {plural(num_seqs, 'sequence')} (prompts times n, best_of or "
                f"beams) but the server lets at most {limit} wait; send fewer",
                code="invalid_parameter",
                param="n",
            )
        waiting = self.num_waiting(llm)
        if waiting + num_seqs > limit:
            self._reject("queue_full")
            raise APIError(
                429,
                f"the server has {plural(waiting, 'sequence')} waiting (at most {limit}); "
                "retry later",
                code="queue_full",
                headers={"Retry-After": "1"},
            )

    def num_waiting(self, llm: AsyncLLM) -> int:
        """Sequences not yet scheduled: the engine's queue (counting the sequences waiting
        requests will fork) plus those of requests handed to its thread but not yet added (the
        thread picks up new requests only between steps)."""
        engine = llm.engine
        not_added = sum(
            seqs for rid, seqs in list(self._engine_requests.items()) if not engine.has_request(rid)
        )
        return engine.stats().num_waiting_seqs + not_added

    def _reject(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected(reason)

    # -- in-flight tracking -------------------------------------------------------------

    def http_started(self) -> None:
        self._http_in_flight += 1
        self._idle.clear()

    def http_finished(self) -> None:
        self._http_in_flight -= 1
        if self._http_in_flight == 0:
            self._idle.set()

    def engine_request_started(self, request_id: str, num_seqs: int) -> None:
        self._engine_requests[request_id] = num_seqs

    def engine_request_finished(self, request_id: str) -> None:
        self._engine_requests.pop(request_id, None)

    async def drain(self) -> None:
        """Refuse new work, let in-flight requests finish, abort what is left at the timeout."""
        if self.draining:
            return
        self.draining = True
        timeout = self.settings.drain_timeout
        log.info("draining", extra={"in_flight": self._http_in_flight, "timeout_s": timeout})
        if await self._wait_idle(timeout):
            log.info("drained")
            return
        aborted = sorted(self._engine_requests)
        log.warning("drain timeout; aborting requests", extra={"aborted": len(aborted)})
        if self.llm is not None:
            for request_id in aborted:
                self.llm.abort(request_id)
        if not await self._wait_idle(ABORT_GRACE_SECONDS):
            log.warning("requests still open after abort", extra={"open": self._http_in_flight})

    async def _wait_idle(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


async def _in_daemon_thread(load: Callable[[], AsyncLLM]) -> AsyncLLM:
    """Like ``asyncio.to_thread``, but a daemon thread, so SIGTERM during a load can exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[AsyncLLM] = loop.create_future()

    def settle(result: AsyncLLM | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            assert result is not None
            future.set_result(result)

    def run() -> None:
        try:
            result = load()
        except BaseException as exc:
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=run, name="ladle-load", daemon=True).start()
    return await future
