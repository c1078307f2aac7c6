"""``ladle`` subcommands of the runtime: generate, serve, bench, eval.

Only the standard library is imported here; each handler imports torch when it runs.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from ladle.flag_types import integer, memory, number
from ladle.settings import Default

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
    # Before torch loads: its C++ warnings are plain text among the JSON lines (c10d warns
    # for each rank that connects when a pod cannot look up 127.0.0.1's name); errors stay.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from ladle.runtime.config import EngineArgs
    from ladle.runtime.limits import RequestLimits
    from ladle.runtime.server.settings import ServerSettings

    settings = ServerSettings.from_namespace(args)
    engine_args = EngineArgs.from_cli_args(args)
    limits = RequestLimits.from_cli_args(args)
    if engine_args.nnodes > 1:
        from ladle.runtime.parallel.secret import parallel_secret

        parallel_secret()  # refused before torch loads, on every node
    if engine_args.node_rank > 0:
        from ladle import logs
        from ladle.runtime.parallel.node import run_node

        logs.configure(settings.log_level)
        return run_node(engine_args)
    from ladle.listen import bind

    # Before torch and the model load: a port already taken fails at once.
    sock = bind(settings.host, settings.port)
    from ladle.runtime.server.main import serve

    return serve(settings, engine_args, limits, sock)


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
        DEFAULT_GROUP_SIZE,
        KV_CACHE_DTYPES,
        QUANTIZATION_METHODS,
        WEIGHT_QUANTIZATIONS,
        EngineArgs,
    )
    from ladle.runtime.limits import RequestLimits

    generate = sub.add_parser(
        "generate",
        help="chat once with a model, offline",
        description="Send one chat message through the engine in this process and print the "
        "answer. Takes the engine flags of ladle serve.",
    )
    generate.add_argument("prompt", help="the user message")
    generate.add_argument(
        "--temperature",
        type=number(0),
        default=0.0,
        help="sampling temperature; 0 is greedy (docs/sampling.md)",
    )
    generate.add_argument(
        "--max-tokens", type=integer(1), default=128, help="tokens to generate at most"
    )
    EngineArgs.add_cli_args(generate)
    generate.set_defaults(func=_generate)

    from ladle.runtime.server.settings import add_server_args

    serve = sub.add_parser(
        "serve",
        help="the OpenAI-compatible server",
        description="Serve a model over the OpenAI API. Every flag can also be set as a "
        "LADLE_SERVE_<FLAG> environment variable (upper case, dashes as underscores) or a key "
        "of the --config YAML file; the command line wins, then the environment, then the file, "
        "then the --env-profile.",
    )
    add_server_args(serve)
    EngineArgs.add_cli_args(serve)
    RequestLimits.add_cli_args(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench", metavar="BENCHMARK", required=True
    )
    throughput = bench.add_parser(
        "throughput", help="offline throughput: ours vs transformers vs the GEMM ceiling"
    )
    throughput.add_argument(
        "--model",
        default=Default(None, "the embedded SmolLM2-135M-Instruct"),
        help="HF folder or .gguf file",
    )
    throughput.add_argument(
        "--workload", choices=[*WORKLOADS, "all"], default="all", help="request set to run"
    )
    throughput.add_argument(
        "--max-num-batched-tokens", type=integer(1), default=2048, help="tokens per engine step"
    )
    throughput.add_argument(
        "--kv-cache-memory", type=memory, default="8Gi", help="KV cache budget (a quantity)"
    )
    throughput.add_argument(
        "--quantization",
        choices=WEIGHT_QUANTIZATIONS,
        default=Default(None, "none"),
        help="weight-only quantization applied at load",
    )
    throughput.add_argument(
        "--quantization-method",
        choices=QUANTIZATION_METHODS,
        default=Default(None, "awq, with --quantization"),
        help="how the weights are quantized",
    )
    throughput.add_argument(
        "--quantization-group-size",
        type=integer(32),
        default=Default(None, f"{DEFAULT_GROUP_SIZE} for int4, per output channel for int8"),
        help="weights per scale and offset, a multiple of 32",
    )
    throughput.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="KV cache element type"
    )
    throughput.add_argument("--seed", type=integer(0), default=0, help="sampling seed")
    throughput.add_argument(
        "--skip-transformers", action="store_true", help="run only our engine and the probe"
    )
    throughput.add_argument(
        "--repeats",
        type=integer(1),
        default=3,
        help="rounds of interleaved runs; the report gives the median and spread over them",
    )
    throughput.add_argument(
        "--json",
        metavar="FILE",
        default=Default(None, "none"),
        help="also write the results to this file",
    )
    throughput.add_argument(
        "--profile", action="store_true", help="then break a decode step down by where time goes"
    )
    throughput.set_defaults(func=_bench_throughput)

    from ladle.runtime.bench.serve_args import add_cli_args as add_bench_serve_args

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
