"""``ladle bench serve``: online load against any OpenAI-compatible server.

Measured on the client, as ``vllm bench serve`` measures, so that Ladle, vLLM and
``transformers serve`` are compared by the same yardstick:

* TTFT: request sent to the first content chunk;
* ITL: the gaps between later content chunks;
* TPOT: (E2EL - TTFT) / (output tokens - 1), per request;
* E2EL: request sent to the last byte.

Arrivals follow gamma(shape=burstiness, scale=1/(rate*burstiness)) (burstiness 1 is Poisson,
an infinite rate sends everything at once); ``--max-concurrency`` caps requests in flight.
Prompts are synthetic: words cut to an exact token count drawn uniformly from
[input_len*(1-r), input_len*(1+r)].

SIGINT or SIGTERM ends a run early: no more requests are sent, those in flight finish, and
the report (and ``--result-file``) covers the requests that were sent. A second signal ends
it at once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ladle.runtime.bench.serve_args import parse_slos, request_headers


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass
class RequestResult:
    success: bool = False
    error: str | None = None
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def meets(result: RequestResult, slos: dict[str, float]) -> bool:
    values = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return result.success and all(values[name] <= limit for name, limit in slos.items())


def summarize(
    results: list[RequestResult],
    duration: float,
    percentiles: list[float],
    slos: dict[str, float],
) -> dict[str, Any]:
    """vLLM's report: throughput over the whole run, latency distributions in milliseconds."""
    import numpy as np

    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    if slos:
        summary["goodput"] = sum(meets(r, slos) for r in done) / duration
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name, values in samples.items():
        ms = np.asarray(values or [0.0]) * 1000.0
        summary[f"mean_{name}_ms"] = float(ms.mean())
        for p in percentiles:
            summary[f"p{p:g}_{name}_ms"] = float(np.percentile(ms, p))
    return summary


def synthetic_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    """Prompts of neutral words cut to an exact token count (re-tokenizing is stable at
    word boundaries, so the server sees the length that was asked for)."""
    import numpy as np

    from ladle.runtime.bench.workloads import WORKLOADS, Workload

    if args.workload is not None:
        workload = WORKLOADS[args.workload]
        return [
            BenchRequest(p, len(tokenizer.encode(p, add_special_tokens=False)), workload.output_len)
            for p in workload.prompts(args.seed)
        ]
    rng = np.random.default_rng(args.seed)

    def lengths(center: int) -> list[int]:
        low = max(1, math.floor(center * (1 - args.range_ratio)))
        high = max(low, math.ceil(center * (1 + args.range_ratio)))
        return [int(x) for x in rng.integers(low, high + 1, size=args.num_prompts)]

    inputs, outputs = lengths(args.input_len), lengths(args.output_len)
    words = max(inputs) + 16  # the word list's words are one or two tokens each
    texts = Workload("random", args.num_prompts, words, words, 0).prompts(args.seed)
    requests = []
    for text, input_len, output_len in zip(texts, inputs, outputs, strict=True):
        ids = tokenizer.encode(text, add_special_tokens=False)[:input_len]
        prompt = tokenizer.decode(ids)
        actual = len(tokenizer.encode(prompt, add_special_tokens=False))
        requests.append(BenchRequest(prompt, actual, output_len))
    return requests


def _payload(args: argparse.Namespace, model: str, request: BenchRequest) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        payload["ignore_eos"] = True
    if args.endpoint == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    return payload


async def send(
    client: Any, url: str, payload: dict[str, Any], request: BenchRequest, tokenizer: Any
) -> RequestResult:
    """One streamed request, timed at each content chunk."""
    result = RequestResult(prompt_len=request.prompt_len)
    pieces: list[str] = []
    usage: dict[str, Any] | None = None
    started = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])
                    return result
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if not pieces:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                    pieces.append(piece)
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - started
    if usage is not None:
        result.output_tokens = int(usage["completion_tokens"])
        result.prompt_len = int(usage.get("prompt_tokens", result.prompt_len))
    else:
        result.output_tokens = len(tokenizer.encode("".join(pieces), add_special_tokens=False))
    result.success = bool(pieces)
    if not result.success:
        result.error = "no content streamed"
    return result


def stop_on_signals() -> threading.Event:
    """An event that SIGINT or SIGTERM sets, the first time; the default handlers are then
    back, so a second signal ends the process as usual. Outside the main thread (where
    signals cannot be handled) it is never set."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return stop
    signals = (signal.SIGINT, signal.SIGTERM)
    defaults = {sig: signal.getsignal(sig) for sig in signals}

    def handler(signum: int, frame: Any) -> None:
        stop.set()
        for sig, previous in defaults.items():
            signal.signal(sig, previous)

    for sig in signals:
        signal.signal(sig, handler)
    return stop


async def run_load(
    args: argparse.Namespace,
    model: str,
    requests: list[BenchRequest],
    tokenizer: Any,
    stop: threading.Event | None = None,
) -> tuple[list[RequestResult], float]:
    """Every request's result, and the run's duration. Once ``stop`` is set no more requests
    are sent: the results are those of the requests that were."""
    import httpx
    import numpy as np

    url = args.base_url + args.endpoint
    headers = request_headers(args)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    rng = np.random.default_rng(args.seed)
    gate = asyncio.Semaphore(args.max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        # One request first, as vllm bench does: a bad URL or model fails fast, untimed. Its
        # prompt is none of the workload's, so no timed request finds it in a prefix cache.
        text = "This request only checks the URL and the model."
        probe = BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), 4)
        check = await send(client, url, _payload(args, model, probe), probe, tokenizer)
        if not check.success:
            raise SystemExit(f"ladle bench serve: the test request failed: {check.error}")

        async def limited(request: BenchRequest) -> RequestResult | None:
            async with gate:
                if stop is not None and stop.is_set():
                    return None  # never sent
                return await send(client, url, _payload(args, model, request), request, tokenizer)

        tasks = []
        started = time.perf_counter()
        for request in requests:
            if stop is not None and stop.is_set():
                break
            tasks.append(asyncio.ensure_future(limited(request)))
            if math.isfinite(args.request_rate):
                shape = args.burstiness
                await asyncio.sleep(rng.gamma(shape, 1.0 / (args.request_rate * shape)))
        results = [r for r in await asyncio.gather(*tasks) if r is not None]
        return results, time.perf_counter() - started


def run_offline(args: argparse.Namespace, requests: list[BenchRequest]) -> dict[str, Any]:
    """The same requests through ``LLM.generate`` in this process: the ceiling for serving."""
    from ladle.runtime.llm import LLM
    from ladle.runtime.sampling_params import SamplingParams

    llm = LLM(kv_cache_memory=args.kv_cache_memory, seed=args.seed)
    params = [
        SamplingParams(
            temperature=args.temperature, max_tokens=r.output_len, ignore_eos=args.ignore_eos
        )
        for r in requests
    ]
    started = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    duration = time.perf_counter() - started
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"duration_s": duration, "output_tokens": tokens, "output_throughput": tokens / duration}


def _print(summary: dict[str, Any], percentiles: list[float]) -> None:
    def row(label: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        print(f"{label:<42}{text:>12}")

    print("{:=^54}".format(" Serving Benchmark Result "))
    if summary.get("not_sent"):
        row("Stopped early; requests not sent:", summary["not_sent"])
    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    if "goodput" in summary:
        row("Request goodput (req/s):", summary["goodput"])
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        print(f"{' ' + title + ' ':-^54}")
        row(f"Mean {name.upper()} (ms):", summary[f"mean_{name}_ms"])
        for p in percentiles:
            row(f"P{p:g} {name.upper()} (ms):", summary[f"p{p:g}_{name}_ms"])
    if "offline" in summary:
        print(f"{' Offline engine, same requests ':-^54}")
        row("Offline output throughput (tok/s):", summary["offline"]["output_throughput"])
        row("Served / offline throughput:", summary["served_over_offline"])
    print("=" * 54)


def served_model(args: argparse.Namespace) -> str:
    """The model to send: ``--model``, else the server's first. Asked before anything slow
    loads, so that a wrong URL or key is one line at once."""
    import httpx

    if args.model is not None:
        return str(args.model)
    url = args.base_url + "/v1/models"
    headers = request_headers(args)
    try:
        listing = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise SystemExit(
            f"ladle bench serve: cannot reach {url}: {exc or type(exc).__name__} "
            "(is the server up? check --base-url)"
        ) from None
    if listing.status_code != 200:
        hint = " (pass --api-key or set OPENAI_API_KEY)" if listing.status_code == 401 else ""
        raise SystemExit(
            f"ladle bench serve: GET {url} answered {listing.status_code}: "
            f"{listing.text[:200]}{hint}"
        )
    try:
        return str(listing.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise SystemExit(
            f"ladle bench serve: GET {url} did not list a model; pass --model"
        ) from None


def main(args: argparse.Namespace) -> int:
    percentiles = args.percentiles
    slos = parse_slos(args.goodput)
    stop = stop_on_signals()
    model = served_model(args)  # before transformers loads: a server not up fails at once
    from transformers import AutoTokenizer

    from ladle.runtime.models.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or resolve_model(None))
    requests = synthetic_requests(args, tokenizer)
    results, duration = asyncio.run(run_load(args, model, requests, tokenizer, stop))
    summary = summarize(results, duration, percentiles, slos)
    if len(results) < len(requests):
        summary["not_sent"] = len(requests) - len(results)
    summary["config"] = {
        k: v for k, v in vars(args).items() if k not in ("func", "api_key") and v is not None
    }
    summary["config"]["model"] = model
    if args.offline:
        summary["offline"] = run_offline(args, requests)
        summary["served_over_offline"] = (
            summary["output_throughput"] / summary["offline"]["output_throughput"]
        )
    _print(summary, percentiles)
    errors = sorted({r.error for r in results if r.error})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({**summary, "requests": [asdict(r) for r in results]}, f, indent=1)
    return 0 if summary["completed"] else 1
