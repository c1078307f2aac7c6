"""What the benchmark scripts share: ``ladle serve`` and ``ladle gateway`` as subprocesses on
free ports, waited on until ready, one ``ladle bench serve`` run read back from its result
file, and an earlier commit's C kernels built to race this checkout's. The scripts beside it
import it by name (a script's folder is first on ``sys.path``)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httptools
import httpx
import psutil
import yaml

LADLE = [sys.executable, "-m", "ladle.cli"]
ROOT = Path(__file__).resolve().parents[1]


def baseline_library(rev: str, folder: Path) -> ctypes.CDLL:
    """The C kernels of commit ``rev``, built in ``folder`` with this checkout's flags, with
    this checkout's signatures for the entry points it has (a benchmark calls only those whose
    signature has not changed)."""
    from ladle.runtime.kernels import cpu_kernels, prebuilt

    for source in (*prebuilt.SOURCES, prebuilt.HEADER):
        relative = source.relative_to(ROOT / "src" / "ladle").as_posix()
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{relative}"],
            capture_output=True,
            text=True,
            check=False,
        )
        if shown.returncode == 0:  # a source added since is left out
            (folder / source.name).write_text(shown.stdout)
    target = folder / "baseline.so"
    cc = cpu_kernels.compiler()
    assert cc is not None, "no C compiler"
    subprocess.run(
        [cc, *cpu_kernels.FLAGS, "-o", str(target), *map(str, folder.glob("*.c")), "-lm"],
        check=True,
        capture_output=True,
    )
    lib = ctypes.CDLL(str(target))
    for name, (restype, argtypes) in cpu_kernels._SIGNATURES.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return lib


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def gateway(
    upstream: int | list[int],
    workdir: Path,
    core: int | None,
    src: Path | None = None,
    routing: dict[str, Any] | None = None,
    flags: tuple[str, ...] = (),
    engine: dict[str, Any] | None = None,
) -> Iterator[tuple[int, psutil.Process]]:
    """A gateway subprocess in front of the backends: this checkout's, or ``src``'s, with
    ``routing`` as the service's ``spec.routing``, ``engine`` as what the backends run
    (``spec.engine``), and more ``flags``."""
    port = free_port()
    routes = workdir / f"routes-{port}.yaml"
    ports = upstream if isinstance(upstream, list) else [upstream]
    service: dict[str, Any] = {
        "name": "bench",
        "model": "bench",
        "endpoints": [f"http://127.0.0.1:{p}" for p in ports],
    }
    if routing is not None:
        service["routing"] = routing
    if engine is not None:
        service["engine"] = engine
    routes.write_text(yaml.safe_dump({"services": [service]}))
    log = (workdir / f"gateway-{port}.log").open("w")
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = str(src / "src")
    proc = subprocess.Popen(
        [
            *LADLE,
            "gateway",
            "--static",
            str(routes),
            "--port",
            str(port),
            "--scrape-interval",
            "0",
            *flags,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        if core is not None:
            os.sched_setaffinity(proc.pid, {core})
        wait_http(f"http://127.0.0.1:{port}/health/ready", 30)
        yield port, psutil.Process(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise SystemExit(f"bench: {url} did not answer within {timeout:.0f} s")


@contextlib.contextmanager
def ladle_serve(
    workdir: Path, max_num_seqs: int, core: int | None = None, flags: tuple[str, ...] = ()
) -> Iterator[int]:
    """A ``ladle serve`` of the embedded model, prefix caching off (no run inherits another's
    cache), ready; pinned to ``core`` with one thread when given, with more ``flags``."""
    port = free_port()
    log = (workdir / f"serve-{port}.log").open("w")
    env = dict(os.environ)
    if core is not None:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    serve = subprocess.Popen(
        [*LADLE, "serve", "--port", str(port), "--no-enable-prefix-caching",
         "--served-model-name", "bench", "--max-num-seqs", str(max_num_seqs), *flags],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    try:
        if core is not None:
            os.sched_setaffinity(serve.pid, {core})
        wait_http(f"http://127.0.0.1:{port}/health/ready", 300)
        yield port
    finally:
        serve.terminate()
        serve.wait(60)
        log.close()


def bench_serve_run(
    url: str,
    prompts: int,
    input_len: int,
    output_len: int,
    concurrency: int,
    out: Path,
    range_ratio: float = 0.0,
    extra: tuple[str, ...] = (),
    allow_failed: bool = False,
) -> dict[str, Any]:
    """One ``ladle bench serve`` run's result; failed requests end the benchmark unless
    ``allow_failed`` (a run meant to overload the server counts them instead)."""
    subprocess.run(
        [*LADLE, "bench", "serve", "--base-url", url, "--model", "bench",
         "--num-prompts", str(prompts), "--input-len", str(input_len),
         "--output-len", str(output_len), "--max-concurrency", str(concurrency),
         "--range-ratio", str(range_ratio),
         "--seed", "0", "--percentiles", "50,99", "--result-file", str(out), *extra],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    result: dict[str, Any] = json.loads(out.read_text())
    if result["failed"] and not allow_failed:
        raise SystemExit(f"bench: {result['failed']} requests failed ({url})")
    return result


class TraceSink(asyncio.Protocol):
    """An OTLP/HTTP receiver that keeps nothing: every export is answered 200 with an empty
    (valid) ExportTraceServiceResponse, and its bytes counted, so a traced process pays for
    building, batching and sending its spans, and never for a slow collector."""

    received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.parser = httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        TraceSink.received += len(data)
        self.parser.feed_data(data)

    def on_message_complete(self) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")


def summary(name: str, values: list[float], unit: str, scale: float = 1.0) -> str:
    """One line of a benchmark's table: the median over rounds and the spread (min-max)."""
    med = statistics.median(values) * scale
    lo, hi = min(values) * scale, max(values) * scale
    return f"{name:<30} median {med:8.2f} {unit}  (spread {lo:.2f}-{hi:.2f}, n={len(values)})"


def time_alone(engine: Any, prompt: Any, params: Any, **request: Any) -> tuple[float, float, int]:
    """One request alone on an offline engine, stepped by hand: (seconds from its arrival to
    its last token, seconds per output token after the first, output tokens)."""
    started = time.perf_counter()
    engine.add_request("bench", prompt, params, **request)
    first: float | None = None
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = len(out.outputs[0].token_ids)
            if first is None and tokens:
                first = time.perf_counter()
    ended = time.perf_counter()
    assert first is not None, "the request produced no token"
    return ended - started, (ended - first) / (tokens - 1), tokens
