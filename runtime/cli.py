"""``ladle`` subcommands of the runtime: generate, serve, bench, eval.

Only the standard library is imported here; each handler imports torch when it runs.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    SubParsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _generate(args: argparse.Namespace) -> int:
    from ladle.runtime.config import EngineArgs
    from ladle.runtime.llm import LLM
    from ladle.runtime.sampling_params import SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{k: v for k, v in vars(engine_args).items() if k != "extra"})
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    messages = [{"role": "user", "content": args.prompt}]
    out = llm.chat(messages, params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from ladle.runtime.config import ConfigError, EngineArgs
    from ladle.runtime.limits import RequestLimits
    from ladle.runtime.server.settings import ServerSettings

    resolved = args.layered.resolve(args)
    try:
        settings = ServerSettings.from_namespace(resolved)
        engine_args = EngineArgs.from_cli_args(resolved)
        limits = RequestLimits.from_cli_args(resolved)
    except ConfigError as exc:
        raise SystemExit(f"ladle serve: {exc}") from None
    from ladle.runtime.server.main import serve

    return serve(settings, engine_args, limits)


def _bench_serve(args: argparse.Namespace) -> int:
    from ladle.runtime.bench.serve import main

    return main(args)


def _bench_throughput(args: argparse.Namespace) -> int:
    from ladle.runtime.bench.throughput import bench

    bench(args)
    return 0


def _bench_latency(args: argparse.Namespace) -> int:
    from ladle.runtime.bench.latency import bench, check_args, profile

    if args.profile:
        check_args(args)
        profile(args)
        return 0
    runs = bench(args)
    return 0 if runs and not any(r.failed for r in runs) else 1


def _eval(args: argparse.Namespace) -> int:
    from ladle.runtime.eval.command import main

    return main(args)


def add_parsers(sub: SubParsers) -> None:
    from ladle.runtime.bench.workloads import WORKLOADS
    from ladle.runtime.config import (
        KV_CACHE_DTYPES,
        QUANTIZATION_METHODS,
        WEIGHT_QUANTIZATIONS,
        EngineArgs,
    )
    from ladle.runtime.limits import RequestLimits

    generate = sub.add_parser("generate", help="chat once with a model, offline")
    generate.add_argument("prompt")
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--max-tokens", type=int, default=128)
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(func=_generate)

    from ladle.runtime.server.settings import LayeredOptions, add_server_args

    serve = sub.add_parser(
        "serve",
        help="the OpenAI-compatible server",
        description="Serve a model over the OpenAI API. Every flag can also be set as a "
        "LADLE_<FLAG> environment variable or a key of the --config YAML file; the command "
        "line wins, then the environment, then the file.",
    )
    add_server_args(serve)
    EngineArgs.add_cli_args(serve)
    RequestLimits.add_cli_args(serve)
    serve.set_defaults(func=_serve, layered=LayeredOptions(serve))

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", metavar="BENCHMARK", required=True
    )
    throughput = bench.add_parser(
        "throughput", help="offline throughput: ours vs transformers vs the GEMM ceiling"
    )
    throughput.add_argument("--model", help="HF folder or .gguf (default: embedded SmolLM2)")
    throughput.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    throughput.add_argument("--max-num-batched-tokens", type=int, default=2048)
    throughput.add_argument("--kv-cache-memory", default="8GiB")
    throughput.add_argument("--quantization", choices=WEIGHT_QUANTIZATIONS)
    throughput.add_argument("--quantization-method", choices=QUANTIZATION_METHODS)
    throughput.add_argument("--quantization-group-size", type=int)
    throughput.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto")
    throughput.add_argument("--seed", type=int, default=0)
    throughput.add_argument("--skip-transformers", action="store_true")
    throughput.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds of interleaved runs; the report gives the median and spread over them",
    )
    throughput.add_argument("--json", help="also write the results to this file")
    throughput.add_argument(
        "--profile", action="store_true", help="then break a decode step down by where time goes"
    )
    throughput.set_defaults(func=_bench_throughput)

    from ladle.runtime.bench.serve import add_cli_args as add_bench_serve_args

    bench_serve = bench.add_parser(
        "serve", help="online load against any OpenAI-compatible server, like vllm bench serve"
    )
    add_bench_serve_args(bench_serve)
    bench_serve.set_defaults(func=_bench_serve)

    from ladle.runtime.bench.latency import add_cli_args as add_bench_latency_args

    latency = bench.add_parser(
        "latency",
        help="TPOT and TTFT at low concurrency, against llama.cpp at equal precision",
    )
    add_bench_latency_args(latency)
    latency.set_defaults(func=_bench_latency)

    from ladle.runtime.eval.command import add_cli_args as add_eval_args

    evaluate = sub.add_parser(
        "eval",
        help="compare a quantized variant with full precision: KLD, top-1, perplexity, greedy",
        description="Teacher-forced comparison of a candidate with a reference on the same "
        "text. Offline (default): the model under the engine flags given against the same "
        "model in full precision, over the full vocabulary. Online: two OpenAI base URLs, "
        "over each position's returned top-k.",
    )
    add_eval_args(evaluate)
    evaluate.set_defaults(func=_eval)
