#!/usr/bin/env python3
"""Response cache benchmark: a hit against a miss, and what the cache adds to a miss.

A real ``ladle serve`` (embedded model, prefix caching off, so that no request inherits
another's KV) behind two gateways in one run: one whose service has ``responseCache`` on, one
started with ``--no-response-cache``. Each round sends, in alternating order, greedy requests
of equal length: a fresh prompt through the plain gateway (the baseline), a fresh prompt
through the caching gateway (a miss: key, capture and store on top of the baseline), and that
same prompt again (a hit). Reports the median and range over rounds of each round's median
latency, the hit's speed-up over a miss, and the miss's added cost over the baseline.

Run on a quiet machine:  .venv/bin/python bench/response_cache.py
                          .venv/bin/python bench/response_cache.py --smoke   (checks it works)
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gateway import LADLE, free_port, wait_http


@contextlib.contextmanager
def process(args: list[str], log: Path, ready: str, timeout: float) -> Iterator[None]:
    with log.open("w") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_http(ready, timeout)
        yield
    finally:
        proc.terminate()
        proc.wait(60)


def gateway_args(workdir: Path, name: str, upstream: int, port: int, cache: bool) -> list[str]:
    routes = workdir / f"{name}.yaml"
    service = {"name": "bench", "model": "bench", "endpoints": [f"http://127.0.0.1:{upstream}"]}
    if cache:
        service["responseCache"] = {"enabled": True}
    routes.write_text(yaml.safe_dump({"services": [service]}))
    flags = [] if cache else ["--no-response-cache"]
    return [*LADLE, "gateway", "--static", str(routes), "--port", str(port),
            "--scrape-interval", "0", *flags]  # fmt: skip


def timed(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> tuple[float, str]:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    started = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = time.perf_counter() - started
    response.raise_for_status()
    return elapsed, response.headers.get("x-ladle-cache", "none")


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):9.2f}  ({min(values):.2f} - {max(values):.2f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=10, help="per kind, per round")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.requests, args.max_tokens = 2, 2, 2
    with tempfile.TemporaryDirectory(prefix="ladle-bench-cache-") as tmp:
        workdir = Path(tmp)
        serve_port, cached_port, plain_port = free_port(), free_port(), free_port()
        serve = [*LADLE, "serve", "--port", str(serve_port), "--no-enable-prefix-caching",
                 "--served-model-name", "bench"]  # fmt: skip
        with (
            process(
                serve, workdir / "serve.log", f"http://127.0.0.1:{serve_port}/health/ready", 300
            ),
            process(
                gateway_args(workdir, "cached", serve_port, cached_port, cache=True),
                workdir / "cached.log",
                f"http://127.0.0.1:{cached_port}/health/ready",
                60,
            ),
            process(
                gateway_args(workdir, "plain", serve_port, plain_port, cache=False),
                workdir / "plain.log",
                f"http://127.0.0.1:{plain_port}/health/ready",
                60,
            ),
            httpx.Client(timeout=300) as client,
        ):
            cached, plain = f"http://127.0.0.1:{cached_port}", f"http://127.0.0.1:{plain_port}"
            rounds: dict[str, list[float]] = {"baseline": [], "miss": [], "hit": []}
            for r in range(args.rounds):
                seen: dict[str, list[float]] = {"baseline": [], "miss": [], "hit": []}
                for i in range(args.requests):
                    prompt = f"Round {r} request {i:04d}: tell me about the number {r * 1000 + i}"
                    order = ("baseline", "cached") if (r + i) % 2 == 0 else ("cached", "baseline")
                    for kind in order:
                        if kind == "baseline":
                            seconds, verdict = timed(client, plain, "B " + prompt, args.max_tokens)
                            assert verdict == "none", verdict
                            seen["baseline"].append(seconds)
                        else:
                            seconds, verdict = timed(client, cached, "C " + prompt, args.max_tokens)
                            assert verdict == "miss", verdict
                            seen["miss"].append(seconds)
                            seconds, verdict = timed(client, cached, "C " + prompt, args.max_tokens)
                            assert verdict == "hit", verdict
                            seen["hit"].append(seconds)
                for kind, values in seen.items():
                    rounds[kind].append(statistics.median(values) * 1000)
    added = [m - b for m, b in zip(rounds["miss"], rounds["baseline"], strict=True)]
    speedup = [m / h for m, h in zip(rounds["miss"], rounds["hit"], strict=True)]
    print(f"{args.rounds} rounds x {args.requests} requests per kind, {args.max_tokens} tokens")
    print(f"{'':28} median of round medians (range)")
    print(f"{'hit latency, ms':28} {spread(rounds['hit'])}")
    print(f"{'miss latency, ms':28} {spread(rounds['miss'])}")
    print(f"{'no-cache latency, ms':28} {spread(rounds['baseline'])}")
    print(f"{'miss minus no-cache, ms':28} {spread(added)}")
    print(f"{'hit speed-up over a miss, x':28} {spread(speedup)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
