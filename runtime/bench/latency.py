"""``ladle bench latency``: per-token latency at low concurrency, against llama.cpp.

What an interactive user feels first is how fast one stream decodes (TPOT) and how soon it
starts (TTFT). For each precision this starts a Ladle server and, with ``--baseline
llama.cpp``, a ``llama-server`` on the same weights at equal precision (``bench/llama_cpp.py``
builds and caches it), then drives both with ``ladle bench serve``'s client at each
concurrency: ``--num-prompts`` requests (default four per slot), ``max_concurrency`` at a time.

Equal work and fair timing: both systems get the same prompts in a run, and each run draws
new ones (a seed per round and concurrency), so no prefix or prompt cache carries over from a
warm-up or an earlier run; the systems alternate within each round, in an order that flips
every round; the table gives each number's median and [min-max] over rounds, and the TPOT
ratio is taken within each round. Running servers can be measured instead of started ones
(``--url``, ``--baseline-url``), one precision at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ladle.flag_types import Invalid, integer
from ladle.settings import Default, Settings
from ladle.words import plural

PRECISIONS = ("fp32", "int8", "int4")
# What each of our precisions is served with: `ladle serve --quantization`.
_QUANTIZATION = {"fp32": None, "int8": "int8", "int4": "int4"}
_READY_TIMEOUT_S = 600.0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise Invalid("expected comma-separated positive integers, such as 1,4,8,32")
    return values


def _precisions(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in PRECISIONS for v in values):
        raise Invalid(f"expected comma-separated precisions from {', '.join(PRECISIONS)}")
    return values


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--baseline",
        choices=("llama.cpp",),
        default=Default(None, "none: Ladle alone"),
        help="also measure this server, at equal precision",
    )
    parser.add_argument(
        "--precisions",
        type=_precisions,
        default="fp32",
        help="comma-separated: fp32 (llama.cpp f32), int8 (Q8_0), int4 (Q4_1, or --llama-int4)",
    )
    parser.add_argument(
        "--concurrency", type=_int_list, default="1,4,8,32", help="requests in flight, per run"
    )
    parser.add_argument("--repeats", type=integer(1), default=3, help="interleaved rounds")
    parser.add_argument("--input-len", type=integer(1), default=64, help="prompt tokens")
    parser.add_argument(
        "--output-len", type=integer(2), default=128, help="tokens per request (TPOT needs 2)"
    )
    parser.add_argument(
        "--num-prompts",
        type=integer(1),
        default=Default(None, "4 per concurrent request"),
        help="requests per run",
    )
    parser.add_argument(
        "--threads",
        type=integer(1),
        default=Default(lambda: os.cpu_count() or 1, "every core"),
        help="CPU threads for each server",
    )
    parser.add_argument("--kv-cache-memory", default="2GiB", help="for the Ladle servers")
    parser.add_argument(
        "--llama-int4", choices=("q4_1", "q4_0"), default="q4_1", help="llama.cpp's int4 format"
    )
    parser.add_argument(
        "--llama-server",
        default=Default(None, "built and cached on first use"),
        help="a llama-server binary (its folder must hold llama-quantize too)",
    )
    parser.add_argument(
        "--url",
        default=Default(None, "start one"),
        help="measure this running Ladle server instead of starting one",
    )
    parser.add_argument(
        "--baseline-url",
        default=Default(None, "start one"),
        help="and this running baseline server",
    )
    parser.add_argument(
        "--json", default=Default(None, "none"), help="also write every run's numbers here"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead: profile a batch-1 decode step in this process, fused and op by op",
    )
    parser.add_argument("--seed", type=integer(0), default=0, help="seed for the prompts")


def check_args(args: argparse.Namespace) -> None:
    """One line naming what to fix, before anything starts."""
    if args.baseline_url and not args.baseline:
        raise SystemExit("ladle bench latency: --baseline-url needs --baseline")
    if (args.url or args.baseline_url) and len(args.precisions) > 1:
        raise SystemExit("ladle bench latency: running servers (--url) serve one precision")
    if args.baseline and args.url and not args.baseline_url:
        raise SystemExit("ladle bench latency: with --url, give the baseline's --baseline-url")


@dataclass
class Run:
    precision: str
    system: str
    concurrency: int
    round: int
    completed: int
    failed: int
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_throughput: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def _server(cmd: list[str], env: dict[str, str], name: str, log_dir: Path) -> Iterator[str]:
    """Start a server, wait until it answers /v1/models, stop it on exit."""
    import httpx

    port = _free_port()
    cmd = [part.replace("{port}", str(port)) for part in cmd]
    log = log_dir / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"ladle bench latency: {name} exited at start; see {log}")
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"ladle bench latency: {name} was not ready in time; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ladle_command(args: argparse.Namespace, precision: str, max_concurrency: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ladle.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "{port}",
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-num-seqs",
        str(max(max_concurrency, 1)),
        *(["--quantization", q] if (q := _QUANTIZATION[precision]) else []),
    ]


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def _bench_namespace(
    args: argparse.Namespace, url: str, concurrency: int, seed: int
) -> argparse.Namespace:
    """The options ``ladle bench serve`` would resolve for one run (its ``LADLE_BENCH_SERVE_*``
    variables aside: this command sets every value it relies on)."""
    from ladle.runtime.bench.serve_args import add_cli_args as add_serve_args

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    settings = Settings(parser, "bench serve")
    num_prompts = args.num_prompts or 4 * concurrency
    typed = parser.parse_args(
        [
            "--base-url",
            url,
            "--num-prompts",
            str(num_prompts),
            "--max-concurrency",
            str(concurrency),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--seed",
            str(seed),
            "--percentiles",
            "50,99",
        ]
    )
    return settings.resolve(typed, environ={})


def measure(
    args: argparse.Namespace, url: str, concurrency: int, seed: int, tokenizer: Any
) -> dict[str, Any]:
    """One ``ladle bench serve`` run: its summary (vLLM's field names)."""
    import httpx

    from ladle.runtime.bench.serve import run_load, summarize, synthetic_requests

    ns = _bench_namespace(args, url, concurrency, seed)
    listing = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
    listing.raise_for_status()
    model = listing.json()["data"][0]["id"]
    requests = synthetic_requests(ns, tokenizer)
    results, duration = asyncio.run(run_load(ns, model, requests, tokenizer))
    return summarize(results, duration, [50.0, 99.0], {})


def _run_record(
    precision: str, system: str, concurrency: int, round_: int, s: dict[str, Any]
) -> Run:
    return Run(
        precision,
        system,
        concurrency,
        round_,
        s["completed"],
        s["failed"],
        s["p50_tpot_ms"],
        s["p99_tpot_ms"],
        s["p50_ttft_ms"],
        s["p99_ttft_ms"],
        s["output_throughput"],
    )


def profile(args: argparse.Namespace) -> None:
    """``--profile``: where a batch-1 step's time goes, per precision, before and after."""
    import torch

    from ladle.runtime.bench.profile import latency_profile
    from ladle.runtime.bench.serve import synthetic_requests
    from ladle.runtime.llm import LLM

    torch.set_num_threads(args.threads)
    for precision in args.precisions:
        llm = LLM(kv_cache_memory=args.kv_cache_memory, quantization=_QUANTIZATION[precision])
        tokenizer = llm.get_tokenizer()
        ns = _bench_namespace(args, "http://127.0.0.1", 1, args.seed)
        text = synthetic_requests(ns, tokenizer)[0].prompt
        print(f"== {precision}")
        print(latency_profile(llm, list(tokenizer.encode(text))), flush=True)
        del llm


def bench(args: argparse.Namespace) -> list[Run]:
    from transformers import AutoTokenizer

    from ladle.runtime.bench import llama_cpp
    from ladle.runtime.models.loader import resolve_model

    check_args(args)
    model_dir = resolve_model(None)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    bin_dir: Path | None = None
    if args.baseline and not args.baseline_url:
        try:
            bin_dir = Path(args.llama_server).parent if args.llama_server else llama_cpp.build()
        except llama_cpp.BaselineError as exc:
            raise SystemExit(f"ladle bench latency: {exc}") from None
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"ladle-bench-latency-{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    most = max(args.concurrency)
    runs: list[Run] = []
    for precision in args.precisions:
        with ExitStack() as stack:
            urls: dict[str, str] = {}
            urls["ladle"] = args.url or stack.enter_context(
                _server(
                    _ladle_command(args, precision, most),
                    _env(args.threads),
                    f"ladle-{precision}",
                    log_dir,
                )
            )
            if args.baseline:
                if args.baseline_url:
                    urls[args.baseline] = args.baseline_url
                else:
                    assert bin_dir is not None
                    try:
                        weights = llama_cpp.gguf(precision, model_dir, bin_dir, args.llama_int4)
                    except llama_cpp.BaselineError as exc:
                        raise SystemExit(f"ladle bench latency: {exc}") from None
                    context = most * (args.input_len + args.output_len + 64)
                    cmd = llama_cpp.server_command(bin_dir, weights, 0, args.threads, most, context)
                    cmd[cmd.index("--port") + 1] = "{port}"
                    urls[args.baseline] = stack.enter_context(
                        _server(cmd, _env(args.threads), f"llama.cpp-{precision}", log_dir)
                    )
            # One untimed run each at the lowest concurrency: the first requests pay for
            # lazy initialization (kernel builds, allocator growth), which is not latency.
            for url in urls.values():
                warm = argparse.Namespace(**{**vars(args), "num_prompts": 2})
                measure(warm, url, 1, args.seed + 10_000, tokenizer)
            for round_ in range(args.repeats):
                order = list(urls) if round_ % 2 == 0 else list(urls)[::-1]
                for concurrency in args.concurrency:
                    seed = args.seed + 100 * round_ + concurrency
                    for system in order:
                        summary = measure(args, urls[system], concurrency, seed, tokenizer)
                        run = _run_record(precision, system, concurrency, round_, summary)
                        runs.append(run)
                        print(
                            f"  round {round_ + 1}/{args.repeats}  {precision:<5}"
                            f" c={concurrency:<3} {system:<10} TPOT p50 {run.tpot_p50_ms:7.1f} ms"
                            f"  TTFT p50 {run.ttft_p50_ms:7.1f} ms"
                            f"  {run.output_throughput:7.1f} tok/s"
                            + (f"  ({run.failed} failed)" if run.failed else ""),
                            flush=True,
                        )
    print("\n" + format_table(runs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": [asdict(r) for r in runs]}, f, indent=1)
    return runs


def _cell(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def format_table(runs: list[Run]) -> str:
    """One row per (precision, concurrency, system): median [min-max] over rounds; the last
    column is Ladle's TPOT p50 over the baseline's, taken within each round."""
    header = (
        "| precision | concurrency | system | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms "
        "| TTFT p99 ms | output tok/s | TPOT p50 / baseline |"
    )
    lines = [
        "median [min-max] over rounds; ratios are taken within each round",
        header,
        "|" + "---|" * (header.count("|") - 1),
    ]
    keys = list(dict.fromkeys((r.precision, r.concurrency) for r in runs))
    systems = list(dict.fromkeys(r.system for r in runs))
    for precision, concurrency in keys:
        here = [r for r in runs if (r.precision, r.concurrency) == (precision, concurrency)]
        by = {(r.system, r.round): r for r in here}
        rounds = sorted({r.round for r in here})
        baseline = next((s for s in systems if s != "ladle"), None)
        for system in systems:
            mine = [by[system, i] for i in rounds if (system, i) in by]
            if not mine:
                continue
            ratio = "-"
            if system == "ladle" and baseline is not None:
                pairs = [
                    by["ladle", i].tpot_p50_ms / by[baseline, i].tpot_p50_ms
                    for i in rounds
                    if ("ladle", i) in by and (baseline, i) in by and by[baseline, i].tpot_p50_ms
                ]
                ratio = _cell(pairs, ".2f") if pairs else "-"
            cells = [
                _cell([r.tpot_p50_ms for r in mine], ".1f"),
                _cell([r.tpot_p99_ms for r in mine], ".1f"),
                _cell([r.ttft_p50_ms for r in mine], ".0f"),
                _cell([r.ttft_p99_ms for r in mine], ".0f"),
                _cell([r.output_throughput for r in mine], ".1f"),
                ratio,
            ]
            lines.append(f"| {precision} | {concurrency} | {system} | " + " | ".join(cells) + " |")
    failed = sum(r.failed for r in runs)
    if failed:
        lines.append(f"{plural(failed, 'request')} failed; see the servers' logs")
    return "\n".join(lines)
