"""A real ``ladle serve`` process on 127.0.0.1, helpers to read its /metrics, and the app in
this process under uvicorn (a thread) around an engine the tests can reach into."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from random_weights import save_random_model, tiny_config

from ladle.runtime import AsyncLLM, EngineArgs
from ladle.runtime.engine import LLMEngine
from ladle.runtime.models.loader import resolve_model
from ladle.runtime.server.app import create_app
from ladle.runtime.server.lifecycle import ServerState
from ladle.runtime.server.settings import ServerSettings

# Small enough to start fast, large enough for 16 concurrent short requests without preemption.
BASE_FLAGS = ("--kv-cache-memory", "64MiB", "--max-model-len", "512")
READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_lines(self) -> list[str]:
        return self.log_path.read_text().splitlines()

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels without model_name)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(
                    sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
                )
                samples[(sample.name, labels)] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_metric(self, name: str, value: float, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while (current := self.metric(name)) != value:
            assert time.monotonic() < deadline, f"{name} stayed {current}, expected {value}"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


def start_server(
    log_dir: Path, *flags: str, env: dict[str, str] | None = None, ready: bool = True
) -> Server:
    port = free_port()
    log_path = log_dir / f"serve-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ladle.cli", "serve", "--port", str(port), *BASE_FLAGS, *flags],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    server = Server(proc, port, log_path)
    deadline = time.monotonic() + READY_TIMEOUT_S
    path = "/health/ready" if ready else "/health/live"
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"ladle serve exited {proc.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{server.url}{path}", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise AssertionError(f"ladle serve not ready in time:\n{log_path.read_text()}")
        time.sleep(0.2)


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def start_gateway(folder: Path, routes: str, *flags: str) -> Gateway:
    """``ladle gateway --static`` with ``routes`` (the static file's YAML), ready to serve."""
    path = folder / "routes.yaml"
    path.write_text(routes)
    port = free_port()
    log = folder / f"gateway-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ladle.cli", "gateway", "--static", str(path),
             "--port", str(port), "--scrape-interval", "0", *flags],
            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ),
        )  # fmt: skip
    gateway = Gateway(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"ladle gateway exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{gateway.url}/health/ready", timeout=5).status_code == 200:
                return gateway
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            gateway.stop()
            raise AssertionError(f"ladle gateway not ready in time:\n{log.read_text()}")
        time.sleep(0.1)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One plain server for the session: starting the model costs seconds on these CPUs."""
    srv = start_server(tmp_path_factory.mktemp("serve"))
    yield srv
    assert srv.stop() == 0, "\n".join(srv.log_lines()[-30:])


@dataclass
class InProcess:
    url: str
    state: ServerState

    @property
    def engine(self) -> LLMEngine:
        assert self.state.llm is not None
        return self.state.llm.engine


@contextlib.contextmanager
def serve_in_thread(engine: LLMEngine, **settings: Any) -> Iterator[InProcess]:
    """The app around ``engine`` under uvicorn in a thread, ready when this yields."""
    config = ServerSettings(port=free_port(), **settings)
    state = ServerState(config, lambda: AsyncLLM(engine))
    server = uvicorn.Server(
        uvicorn.Config(create_app(state), host="127.0.0.1", port=config.port, log_config=None)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not state.ready:
        assert thread.is_alive(), "the server thread died"
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.05)
    try:
        yield InProcess(f"http://127.0.0.1:{config.port}", state)
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with the default model's tokenizer: real text, fast steps."""
    default = resolve_model(None)
    folder = tmp_path_factory.mktemp("tiny-server")
    return save_random_model(tiny_config("llama", 49152), folder, default)


@pytest.fixture(scope="module")
def tiny_server(tiny_model_path: Path) -> Iterator[InProcess]:
    """The tiny model behind the real app, without prefix caching, so that the same request
    twice runs the same computation (streamed and non-streamed responses compare exactly)."""
    args = EngineArgs(
        model=str(tiny_model_path),
        kv_cache_memory=16 << 20,
        max_model_len=256,
        enable_prefix_caching=False,
    )
    with serve_in_thread(LLMEngine(args)) as srv:
        yield srv
