#!/usr/bin/env python3
"""Tracing's cost on real serving: ``ladle bench serve`` through the gateway to a ``ladle serve``
of the embedded model, with both tracing every request (ratio 1) to an OTLP sink, against both
not tracing, same requests, in alternating rounds.

Each round starts its own runtime and gateway (one pair at a time: the machine has two cores),
with prefix caching off, so that no run inherits another's cache. The sink answers every export
at once and keeps nothing: the traced side pays for making, batching, encoding and sending its
spans, never for a slow collector. Target: throughput with tracing >= 97% of without.

The gateway's own cost per request, where it is the bottleneck (a backend that answers at once),
is ``bench/gateway.py proxy --traced``.

Run on a quiet machine:  .venv/bin/python bench/tracing.py --repeats 3
                          .venv/bin/python bench/tracing.py --smoke
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from harness import TraceSink, bench_serve_run, gateway, ladle_serve

TARGET_RATIO = 0.97


@contextlib.contextmanager
def sink() -> Iterator[str]:
    """The sink on its own thread and loop; yields its base URL."""
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(TraceSink, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def run(args: argparse.Namespace, workdir: Path, endpoint: str, traced: bool, i: int) -> float:
    flags = ("--otlp-traces-endpoint", endpoint, "--trace-sample-ratio", "1") if traced else ()
    with (
        ladle_serve(workdir, args.max_concurrency, flags=flags) as port,
        gateway(port, workdir, None, flags=flags) as (gw_port, _),
    ):
        out = workdir / f"{'traced' if traced else 'plain'}-{i}.json"
        result = bench_serve_run(
            f"http://127.0.0.1:{gw_port}",
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.max_concurrency,
            out,
        )
    return float(result["request_throughput"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script works")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.num_prompts, args.output_len = 1, 8, 4
    rates: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp, sink() as endpoint:
        for i in range(args.repeats):
            for traced in (False, True) if i % 2 == 0 else (True, False):
                rates[traced].append(run(args, Path(tmp), endpoint, traced, i))
    ratios = [t / p for p, t in zip(rates[False], rates[True], strict=True)]
    ratio = statistics.median(ratios)
    print(
        f"\ntracing's cost, ladle bench serve through the gateway: {args.num_prompts} prompts, "
        f"{args.input_len} in / {args.output_len} out, concurrency {args.max_concurrency}, "
        f"x {args.repeats} (alternating; {TraceSink.received:,} bytes of spans exported)"
    )
    for traced, label in ((False, "not tracing"), (True, "tracing every request")):
        values = rates[traced]
        print(
            f"  {label:24} requests/s median {statistics.median(values):7.2f} "
            f"({min(values):.2f} - {max(values):.2f})"
        )
    print(
        f"  traced / plain, round by round: median {ratio:.3f} "
        f"({min(ratios):.3f} - {max(ratios):.3f}); target >= {TARGET_RATIO}"
    )
    if not TraceSink.received:
        print("  no span reached the sink: the traced runs did not trace")
        return 1
    return 0 if ratio >= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
