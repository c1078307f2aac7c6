#!/usr/bin/env python3
"""Gateway benchmark: what the gateway adds, against going straight to the pod, same run.

``proxy``: a trivial backend inside this process (raw asyncio, answers at once), the gateway as
a subprocess pinned to one core, and a keep-alive load generator in this process on the other
cores. Direct and gateway runs alternate; each reports requests/s (non-streaming) and streamed
chunks/s, plus the gateway's requests per CPU-second (robust to a busy machine). Targets:
>= 1,000 requests/s and >= 10,000 chunks/s on one core. Then one stream at a time, the time to
the first event, direct and through the gateway in alternating rounds: the gateway's own
latency, with no model noise in it.

``serve``: a real ``ladle serve`` (embedded model, prefix caching off so that no run inherits
another's cache) and the gateway in front of it, direct and through the gateway, alternating,
with the same requests. At saturation (``ladle bench serve``, concurrency 32), the throughput
ratio; TTFT there is mostly queueing, hundreds of ms apart run to run, so it is shown but not
judged. One request at a time, the added TTFT (the gateway's p50 and p99 less direct's).
Targets: throughput >= 97% of direct, added TTFT p50 <= 2 ms and p99 <= 10 ms.

``proxy --baseline-src DIR`` also runs the gateway of another checkout (say a ``git worktree``
of the commit before a change) in the same rounds, in turn with this one, and prints the two
medians' ratio: a before/after comparison on equal work, on one machine, in one run.

Run on a quiet machine:  .venv/bin/python bench/gateway.py            (both parts)
                          .venv/bin/python bench/gateway.py proxy --repeats 5
                          .venv/bin/python bench/gateway.py proxy --baseline-src /tmp/before
                          .venv/bin/python bench/gateway.py --smoke  (seconds; checks it works)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httptools
import numpy as np
from harness import TraceSink, bench_serve_run, gateway, ladle_serve

from ladle.gateway.upstream import Pool

ROOT = Path(__file__).resolve().parent.parent
TARGET_RPS = 1000.0
TARGET_CHUNKS = 10_000.0
TARGET_THROUGHPUT_RATIO = 0.97
TARGET_ADDED_TTFT_P50_MS = 2.0
TARGET_ADDED_TTFT_P99_MS = 10.0

BODY = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "bench",
        "choices": [{"index": 0, "text": "hello", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
CHUNK = b'data: {"id":"c","object":"text_completion","choices":[{"index":0,"text":"t"}]}\n\n'


# -- the trivial backend ---------------------------------------------------------------


class _Backend(asyncio.Protocol):
    """Answers at once: a JSON body, or ``chunks`` SSE events written one loop turn apart."""

    chunks = 64

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: Any = transport
        self.parser = httptools.HttpRequestParser(self)
        self.body = b""

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        stream = b'"stream": true' in self.body or b'"stream":true' in self.body
        self.body = b""
        if stream:
            self.streaming = asyncio.ensure_future(self._stream())
        else:
            head = (
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            )
            self.transport.write(head % len(BODY) + BODY)

    async def _stream(self) -> None:
        write = self.transport.write
        write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        piece = b"%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
        for _ in range(self.chunks):
            await asyncio.sleep(0)
            if self.transport.is_closing():
                return
            write(piece)
        done = b"data: [DONE]\n\n"
        write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))


# -- the load generator ----------------------------------------------------------------


async def load(port: int, seconds: float, concurrency: int, stream: bool) -> tuple[float, float]:
    """Requests/s and SSE events/s over ``seconds`` after a short warm-up."""
    pool = Pool()
    body = json.dumps({"model": "bench", "prompt": "hello", "stream": stream}).encode()
    headers = [(b"content-type", b"application/json")]
    counts = [0, 0]
    counting = False
    stop = False

    async def worker() -> None:
        while not stop:
            response = await pool.request(
                "127.0.0.1", port, b"POST", b"/v1/completions", headers, body
            )
            events = 0
            while (piece := await response.read()) is not None:
                events += piece.count(b"data: ")
            if response.status != 200:
                raise RuntimeError(f"status {response.status}")
            if counting:
                counts[0] += 1
                counts[1] += events

    tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    await asyncio.sleep(min(1.0, seconds / 4))
    counting = True
    started = time.perf_counter()
    await asyncio.sleep(seconds)
    elapsed = time.perf_counter() - started
    counting = False
    stop = True
    await asyncio.gather(*tasks, return_exceptions=True)
    pool.close()
    return counts[0] / elapsed, counts[1] / elapsed


async def first_events(port: int, count: int) -> list[float]:
    """Milliseconds from sending each of ``count`` streamed requests, one at a time, to its
    first event; then the stream is read to its end, so each request reuses the connection."""
    pool = Pool()
    body = json.dumps({"model": "bench", "prompt": "hello", "stream": True}).encode()
    headers = [(b"content-type", b"application/json")]
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        response = await pool.request("127.0.0.1", port, b"POST", b"/v1/completions", headers, body)
        first = await response.read()
        latencies.append((time.perf_counter() - started) * 1000)
        if response.status != 200 or not first:
            raise RuntimeError(f"status {response.status}")
        while await response.read() is not None:
            pass
    pool.close()
    return latencies


def spread(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:10,.0f}  ({min(values):,.0f} - {max(values):,.0f})"


def bench_proxy(args: argparse.Namespace, workdir: Path) -> bool:
    cores = sorted(os.sched_getaffinity(0))
    gateway_core = cores[0] if len(cores) > 1 else None
    if gateway_core is not None:
        os.sched_setaffinity(0, set(cores[1:]))
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    _Backend.chunks = args.chunks
    server = loop.run_until_complete(loop.create_server(_Backend, "127.0.0.1", 0))
    backend_port = server.sockets[0].getsockname()[1]
    targets = (
        ["direct", "gw"]
        + (["base"] if args.baseline_src else [])
        + (["traced"] if args.traced else [])
    )
    rows: dict[str, list[float]] = {
        f"{t}_{m}": [] for t in targets for m in ("rps", "cps", "rps_cpu", "cps_cpu")
    }
    with contextlib.ExitStack() as stack:
        gateways = {"gw": stack.enter_context(gateway(backend_port, workdir, gateway_core))}
        if args.baseline_src:
            gateways["base"] = stack.enter_context(
                gateway(backend_port, workdir, gateway_core, args.baseline_src)
            )
        if args.traced:
            sink = loop.run_until_complete(loop.create_server(TraceSink, "127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{sink.sockets[0].getsockname()[1]}"
            gateways["traced"] = stack.enter_context(
                gateway(
                    backend_port,
                    workdir,
                    gateway_core,
                    flags=("--otlp-traces-endpoint", endpoint, "--trace-sample-ratio", "1"),
                )
            )
        ports = {"direct": backend_port, **{t: port for t, (port, _) in gateways.items()}}
        for i in range(args.repeats):
            order = targets[i % len(targets) :] + targets[: i % len(targets)]
            for stream in (False, True):
                for target in order:
                    proc = gateways[target][1] if target in gateways else None
                    before = proc.cpu_times() if proc is not None else None
                    rps, cps = loop.run_until_complete(
                        load(ports[target], args.seconds, args.concurrency, stream)
                    )
                    rate, per_cpu = (cps, "cps") if stream else (rps, "rps")
                    rows[f"{target}_{per_cpu}"].append(rate)
                    if proc is not None and before is not None:
                        cpu = sum(proc.cpu_times()[:2]) - sum(before[:2])
                        # Load ran for the warm-up as well; the CPU time covers both.
                        span = args.seconds + min(1.0, args.seconds / 4)
                        rows[f"{target}_{per_cpu}_cpu"].append(rate * span / max(cpu, 1e-9))
        rounds: list[dict[str, list[float]]] = []
        for i in range(args.repeats * 2):
            rounds.append({})
            for target in targets[i % len(targets) :] + targets[: i % len(targets)]:
                rounds[-1][target] = loop.run_until_complete(
                    first_events(ports[target], args.latency_requests)
                )
    server.close()
    loop.close()
    pinned = (
        f"pinned to core {gateway_core}" if gateway_core is not None else "not pinned (one core)"
    )
    print(
        f"\nproxy benchmark: gateway {pinned}, {args.concurrency} connections, "
        f"{args.seconds:g} s x {args.repeats}"
    )
    names = {
        "gw": "through the gateway",
        "base": "through the baseline gateway",
        "traced": "through the gateway, tracing every request",
    }
    print(f"  {'':44} {'median':>10}  (min - max)")
    print(f"  {'direct to the backend, requests/s':44} {spread(rows['direct_rps'])}")
    for t in gateways:
        print(f"  {names[t] + ', requests/s':44} {spread(rows[f'{t}_rps'])}")
        print(f"  {'  per gateway CPU-second':44} {spread(rows[f'{t}_rps_cpu'])}")
    print(f"  {'direct, streamed chunks/s':44} {spread(rows['direct_cps'])}")
    for t in gateways:
        print(f"  {names[t] + ', chunks/s':44} {spread(rows[f'{t}_cps'])}")
        print(f"  {'  per gateway CPU-second':44} {spread(rows[f'{t}_cps_cpu'])}")
    if args.baseline_src:
        print(f"  this gateway / the baseline's ({args.baseline_src}), by the medians:")
        for metric, label in (("rps", "requests/s"), ("cps", "chunks/s")):
            for suffix, what in (("", ""), ("_cpu", " per CPU-second")):
                ratio = statistics.median(rows[f"gw_{metric}{suffix}"]) / statistics.median(
                    rows[f"base_{metric}{suffix}"]
                )
                print(f"    {label + what:36} {ratio:10.3f}")
    if args.traced:
        print(f"  tracing every request / not tracing, by the medians ({TraceSink.received:,} "
              "bytes of spans exported):")  # fmt: skip
        for metric, label in (("rps", "requests/s"), ("cps", "chunks/s")):
            ratio = statistics.median(rows[f"traced_{metric}"]) / statistics.median(
                rows[f"gw_{metric}"]
            )
            print(f"    {label:36} {ratio:10.3f}  (target >= 0.97)")
    first = {t: [ms for r in rounds for ms in r[t]] for t in targets}
    print(
        f"  one stream at a time, ms to the first event ({len(first['gw']):,} requests each, "
        f"{len(rounds)} alternating rounds):"
    )
    print(f"  {'':44} {'p50':>10} {'p99':>10}")
    for target in targets:
        p50, p99 = np.percentile(first[target], (50, 99))
        print(f"  {names.get(target, 'direct to the backend'):44} {p50:10.3f} {p99:10.3f}")
    added = np.percentile(first["gw"], (50, 99)) - np.percentile(first["direct"], (50, 99))
    print(f"  {'added by the gateway':44} {added[0]:+10.3f} {added[1]:+10.3f}")
    per_round = [
        np.percentile(r["gw"], (50, 99)) - np.percentile(r["direct"], (50, 99)) for r in rounds
    ]
    print(
        "  added, round by round: "
        + ", ".join(
            f"p{q} median {statistics.median(a[j] for a in per_round):+.3f} "
            f"({min(a[j] for a in per_round):+.3f} - {max(a[j] for a in per_round):+.3f})"
            for j, q in enumerate((50, 99))
        )
    )
    rps, cps = statistics.median(rows["gw_rps"]), statistics.median(rows["gw_cps"])
    ok = rps >= TARGET_RPS and cps >= TARGET_CHUNKS
    print(
        f"  target >= {TARGET_RPS:,.0f} requests/s: {'met' if rps >= TARGET_RPS else 'MISSED'}; "
        f">= {TARGET_CHUNKS:,.0f} chunks/s: {'met' if cps >= TARGET_CHUNKS else 'MISSED'}"
    )
    return ok


# -- ladle bench serve, direct and through the gateway ---------------------------------


def ttft_gaps(runs: dict[str, list[dict[str, Any]]], q: int) -> list[float]:
    """The gateway's TTFT percentile less direct's, run by run."""
    return [
        g[f"p{q}_ttft_ms"] - d[f"p{q}_ttft_ms"]
        for d, g in zip(runs["direct"], runs["gw"], strict=True)
    ]


def bench_serve(args: argparse.Namespace, workdir: Path) -> bool:
    results: dict[str, list[dict[str, Any]]] = {"direct": [], "gw": []}
    single: dict[str, list[dict[str, Any]]] = {"direct": [], "gw": []}
    with (
        ladle_serve(workdir, args.max_concurrency) as port,
        gateway(port, workdir, None) as (gw_port, _),
    ):
        for i in range(args.repeats):
            order = ("direct", "gw") if i % 2 == 0 else ("gw", "direct")
            for into, prompts, output_len, concurrency in (
                (results, args.num_prompts, args.output_len, args.max_concurrency),
                (single, args.single_prompts, 1, 1),
            ):
                for target in order:
                    url = f"http://127.0.0.1:{port if target == 'direct' else gw_port}"
                    out = workdir / f"{target}-{concurrency}-{i}.json"
                    into[target].append(
                        bench_serve_run(url, prompts, args.input_len, output_len, concurrency, out)
                    )
    ratios = [
        g["request_throughput"] / d["request_throughput"]
        for d, g in zip(results["direct"], results["gw"], strict=True)
    ]

    def med(key: str, target: str, runs: dict[str, list[dict[str, Any]]] = results) -> float:
        return float(statistics.median(r[key] for r in runs[target]))

    print(
        f"\nladle bench serve at saturation: {args.num_prompts} prompts, {args.input_len} in / "
        f"{args.output_len} out, concurrency {args.max_concurrency}, x {args.repeats} (alternating)"
    )
    print(f"  {'':28} {'direct':>10} {'gateway':>10}")
    for key, label in (
        ("request_throughput", "requests/s"),
        ("output_throughput", "output tokens/s"),
        ("p50_ttft_ms", "TTFT p50 (ms)"),
        ("p99_ttft_ms", "TTFT p99 (ms)"),
    ):
        print(f"  {label:28} {med(key, 'direct'):10.2f} {med(key, 'gw'):10.2f}")
    ratio = float(statistics.median(ratios))
    print(
        f"  throughput ratio {ratio:.3f} (runs {min(ratios):.3f} - {max(ratios):.3f}); "
        f"target >= {TARGET_THROUGHPUT_RATIO}"
    )
    print(
        f"  TTFT gateway less direct: p50 {statistics.median(ttft_gaps(results, 50)):+.1f} ms, "
        f"p99 {statistics.median(ttft_gaps(results, 99)):+.1f} ms (queueing at saturation; "
        "not judged)"
    )
    added = {q: ttft_gaps(single, q) for q in (50, 99)}
    add50, add99 = statistics.median(added[50]), statistics.median(added[99])
    print(
        f"\none request at a time: {args.single_prompts} prompts, {args.input_len} in / 1 out, "
        f"x {args.repeats} (alternating)"
    )
    print(f"  {'':28} {'direct':>10} {'gateway':>10}")
    for key, label in (("p50_ttft_ms", "TTFT p50 (ms)"), ("p99_ttft_ms", "TTFT p99 (ms)")):
        print(f"  {label:28} {med(key, 'direct', single):10.2f} {med(key, 'gw', single):10.2f}")
    for q, value, goal in (
        (50, add50, TARGET_ADDED_TTFT_P50_MS),
        (99, add99, TARGET_ADDED_TTFT_P99_MS),
    ):
        runs = added[q]
        print(
            f"  added TTFT p{q} {value:+.2f} ms (runs {min(runs):+.2f} - {max(runs):+.2f}); "
            f"target <= {goal}"
        )
    return (
        ratio >= TARGET_THROUGHPUT_RATIO
        and add50 <= TARGET_ADDED_TTFT_P50_MS
        and add99 <= TARGET_ADDED_TTFT_P99_MS
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=("all", "proxy", "serve"), default="all")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0, help="proxy: per run")
    parser.add_argument("--concurrency", type=int, default=64, help="proxy: connections")
    parser.add_argument("--chunks", type=int, default=64, help="proxy: events per stream")
    parser.add_argument(
        "--latency-requests", type=int, default=1000, help="proxy: per round, one at a time"
    )
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument(
        "--single-prompts", type=int, default=100, help="serve: per run, one at a time"
    )
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=32)
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="proxy: also run the gateway of this checkout (a git worktree), in turn",
    )
    parser.add_argument(
        "--traced",
        action="store_true",
        help="proxy: also a gateway that traces every request to a local OTLP sink, in turn",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script works")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.seconds, args.concurrency = 1, 1.0, 8
        args.num_prompts, args.input_len, args.output_len, args.max_concurrency = 4, 16, 4, 4
        args.latency_requests, args.single_prompts = 20, 4
    ok = True
    with tempfile.TemporaryDirectory(prefix="ladle-bench-gw-") as tmp:
        if args.part in ("all", "proxy"):
            ok &= bench_proxy(args, Path(tmp))
        if args.part in ("all", "serve"):
            ok &= bench_serve(args, Path(tmp))
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
