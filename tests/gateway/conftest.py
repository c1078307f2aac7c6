"""Fixtures for the gateway's data-path tests: scriptable fake pods and a gateway in-process.

A ``FakePod`` is a real HTTP/1.1 server on 127.0.0.1 (raw asyncio, so it can misbehave in
ways a framework would not let it: hang before the first byte, die mid-stream). The gateway
runs under uvicorn in the test's own event loop, from a static routes file, and is called
over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httptools
import httpx
import pytest
import uvicorn
import yaml

from ladle.gateway.main import Gateway
from ladle.gateway.settings import GatewaySettings


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakePod:
    """Answers according to ``mode``: ok, stream, status:<code>, hang, die_mid_stream,
    close_before_answer. ``delay`` seconds pass before the answer starts.

    As an engine with ``slots`` sequences, it counts the requests it holds: those past its
    slots wait (``peak_waiting`` is the most that ever did), and ``GET /metrics`` reports them
    as a runtime does. Each request's ``x-request-id`` is recorded in ``order`` as it starts."""

    mode: str = "ok"
    delay: float = 0.0
    chunks: int = 3
    chunk_gap: float = 0.0
    # Set: after the [DONE] event the body stays open until the test sets it.
    hold_body: asyncio.Event | None = None
    seen: list[Seen] = field(default_factory=list)
    disconnects: int = 0
    slots: int = 256
    active: int = 0
    peak_waiting: int = 0
    order: list[str] = field(default_factory=list)
    port: int = 0
    _server: asyncio.AbstractServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _PodProtocol(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


class _PodProtocol(asyncio.Protocol):
    def __init__(self, pod: FakePod) -> None:
        self.pod = pod
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body = b""
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None and not self.task.done():
            self.pod.disconnects += 1
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        if self.url == b"/metrics":
            self.headers, self.body = {}, b""
            self.metrics()
            return
        body = json.loads(self.body) if self.body else {}
        self.pod.seen.append(Seen(self.url.decode(), dict(self.headers), body))
        self.task = asyncio.ensure_future(self.answer(body))
        self.headers, self.body = {}, b""

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    def metrics(self) -> None:
        pod = self.pod
        running, waiting = min(pod.active, pod.slots), max(0, pod.active - pod.slots)
        page = (
            f"ladle:num_requests_running {running}\nladle:num_requests_waiting {waiting}\n"
            "ladle:kv_cache_usage_perc 0.1\n"
        ).encode()
        self.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page))

    async def answer(self, body: dict[str, Any]) -> None:
        pod = self.pod
        pod.active += 1
        pod.peak_waiting = max(pod.peak_waiting, pod.active - pod.slots)
        pod.order.append(self.pod.seen[-1].headers.get("x-request-id", ""))
        try:
            await self._answer(body)
        finally:
            pod.active -= 1

    async def _answer(self, body: dict[str, Any]) -> None:
        pod = self.pod
        mode = pod.mode
        if pod.delay:
            await asyncio.sleep(pod.delay)
        if mode == "hang":
            await asyncio.sleep(3600)
        if mode == "close_before_answer":
            assert self.transport is not None
            self.transport.close()
            return
        if mode.startswith("status:"):
            code = int(mode.split(":")[1])
            payload = json.dumps(
                {"error": {"message": f"pod says {code}", "type": "x", "code": "x"}}
            ).encode()
            self.write(
                b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (code, len(payload), payload)
            )
            return
        model = body.get("model", "")
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        if body.get("stream") or mode in ("stream", "die_mid_stream"):
            self.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            for i in range(pod.chunks):
                if pod.chunk_gap:
                    await asyncio.sleep(pod.chunk_gap)
                event = json.dumps(
                    {"model": model, "choices": [{"index": 0, "text": f"t{i}"}], "usage": None}
                )
                data = f"data: {event}\n\n".encode()
                if mode == "die_mid_stream" and i == pod.chunks - 1:
                    self.write(b"%x\r\n%s\r\n" % (len(data) // 2, data[: len(data) // 2]))
                    assert self.transport is not None
                    self.transport.abort()
                    return
                self.write(b"%x\r\n%s\r\n" % (len(data), data))
            if (body.get("stream_options") or {}).get("include_usage"):
                event = json.dumps({"model": model, "choices": [], "usage": usage})
                data = f"data: {event}\n\n".encode()
                self.write(b"%x\r\n%s\r\n" % (len(data), data))
            done = b"data: [DONE]\n\n"
            self.write(b"%x\r\n%s\r\n" % (len(done), done))
            if pod.hold_body is not None:
                await pod.hold_body.wait()
            self.write(b"0\r\n\r\n")
            return
        payload = json.dumps(
            {"model": model, "choices": [{"index": 0, "text": "hi"}], "usage": usage}
        ).encode()
        self.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (len(payload), payload)
        )


@pytest.fixture
async def fake_pods() -> AsyncIterator[Callable[..., Any]]:
    started: list[FakePod] = []

    async def make(**kwargs: Any) -> FakePod:
        pod = FakePod(**kwargs)
        await pod.start()
        started.append(pod)
        return pod

    yield make
    for pod in started:
        await pod.stop()


@dataclass
class RunningGateway:
    gateway: Gateway
    url: str


@pytest.fixture
async def run_gateway(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    """``await run_gateway(services, **settings)`` starts a gateway on a free port."""
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(services: list[dict[str, Any]], **settings: Any) -> RunningGateway:
        path = tmp_path / f"routes-{len(servers)}.yaml"
        path.write_text(yaml.safe_dump({"services": services}))
        gateway = Gateway(GatewaySettings(static=path, **{"scrape_interval": 0, **settings}))
        config = uvicorn.Config(
            gateway.app(),
            host="127.0.0.1",
            port=0,
            log_config=None,
            lifespan="on",
            http="httptools",
        )
        server = uvicorn.Server(config)
        task = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        servers.append((server, task))
        return RunningGateway(gateway, f"http://127.0.0.1:{port}")

    yield start
    for server, task in servers:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 10)


# ---- cluster fixtures: the chart's RBAC for the gateway, real processes ------------------

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ladle"
SYSTEM_NAMESPACE = "ladle-system"
GATEWAY_ACCOUNT = "ladle-gateway"  # the chart's gateway ServiceAccount for release "ladle"


@pytest.fixture(scope="session")
def gateway_chart(k8s_cluster: Any) -> str:
    """The chart installed with no operator or gateway replicas (the operator tests install it
    the same way): CRDs, and the gateway's ServiceAccount and RBAC for processes run as it."""
    result = subprocess.run(
        [
            str(k8s_cluster.helm), "upgrade", "--install", "ladle", str(CHART),
            "--namespace", SYSTEM_NAMESPACE, "--create-namespace",
            "--set", "replicas=0", "--set", "gateway.replicas=0", "--wait", "--timeout", "120s",
        ],
        env=k8s_cluster.env(), capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    waited = k8s_cluster.run_kubectl(
        "wait", "--for=condition=Established", "crd/inferenceservices.ladle.dev", "--timeout=60s"
    )
    assert waited.returncode == 0, waited.stderr
    return SYSTEM_NAMESPACE


@dataclass
class Process:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_ladle(log: Path, *argv: str, port: int, env: dict[str, str] | None = None) -> Process:
    """``ladle <argv>`` on 127.0.0.1:port, waited on until /health/ready answers 200."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ladle.cli", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    started = Process(proc, port, log)
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"ladle {argv[0]} exited {proc.returncode}:\n{started.log_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(started.url + "/health/ready", timeout=5).status_code == 200:
                return started
        if time.monotonic() > deadline:
            started.stop()
            raise AssertionError(f"ladle {argv[0]} not ready:\n{started.log_text()}")
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Small enough to start fast; enough KV for a few concurrent short requests.
SERVE_FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")


def start_runtime(log_dir: Path, model: str) -> Process:
    port = free_port()
    return start_ladle(
        log_dir / f"serve-{port}.log",
        "serve", "--port", str(port), "--served-model-name", model, *SERVE_FLAGS,
        port=port,
    )  # fmt: skip
