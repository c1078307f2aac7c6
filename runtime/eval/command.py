"""``ladle eval``: compare a candidate with a reference, offline or against two servers.

Offline, the candidate is the model under the engine flags given (``--quantization int4``,
``--kv-cache-dtype int8``, ...) and the reference is the same model in full precision. Online,
both are OpenAI base URLs. Exits 1 when ``--gate`` is given and the candidate fails it, 2 on
bad input (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ladle.flag_types import existing_file, integer
from ladle.runtime.eval.metrics import GATES, EvalResult
from ladle.runtime.eval.prompts import PromptFileError, load_prompts
from ladle.settings import Default


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from ladle.runtime.config import EngineArgs

    group = parser.add_argument_group("comparison")
    group.add_argument(
        "--prompts",
        type=existing_file,
        default=Default(None, "the built-in prompt set"),
        help="prompt file (.json, .jsonl or lines)",
    )
    group.add_argument(
        "--max-prompts",
        type=integer(1),
        default=Default(None, "all"),
        help="score only the first N prompts",
    )
    group.add_argument(
        "--greedy-tokens", type=integer(1), default=16, help="N for greedy agreement"
    )
    group.add_argument(
        "--gate",
        choices=sorted(GATES),
        default=Default(None, "none: report only"),
        help="exit 1 unless this gate passes",
    )
    group.add_argument(
        "--json",
        type=Path,
        default=Default(None, "stdout only"),
        help="also write the result to this file",
    )
    online = parser.add_argument_group("online (both URLs: OpenAI base URLs ending in /v1)")
    online.add_argument(
        "--reference-url",
        default=Default(None, "offline: the model in full precision"),
        help="the reference server's OpenAI base URL",
    )
    online.add_argument(
        "--candidate-url",
        default=Default(None, "offline: the model under the engine flags"),
        help="the candidate server's OpenAI base URL",
    )
    online.add_argument(
        "--reference-model",
        default=Default(None, "the server's only model"),
        help="`model` for the reference server",
    )
    online.add_argument(
        "--candidate-model",
        default=Default(None, "the server's only model"),
        help="`model` for the candidate server",
    )
    online.add_argument(
        "--api-key", default=Default(None, "none"), help="bearer key for both servers"
    )
    online.add_argument("--top-k", type=integer(1), default=20, help="prompt logprobs per position")
    online.add_argument(
        "--protocol",
        choices=("auto", "prompt_logprobs", "echo"),
        default="auto",
        help="how to get prompt logprobs (auto: prompt_logprobs, else echo + logprobs)",
    )
    EngineArgs.add_cli_args(parser)


def _offline(args: argparse.Namespace) -> EvalResult:
    import dataclasses

    from ladle.runtime.config import EngineArgs
    from ladle.runtime.eval.offline import evaluate_offline
    from ladle.runtime.llm import LLM

    candidate_args = EngineArgs.from_cli_args(args)
    reference_args = dataclasses.replace(
        candidate_args,
        quantization=None,
        quantization_method=None,
        quantization_group_size=None,
        kv_cache_dtype="auto",
    )
    prompts = load_prompts(args.prompts)[: args.max_prompts]
    fields = {f.name for f in dataclasses.fields(EngineArgs)} - {"extra"}
    reference = LLM(**{k: getattr(reference_args, k) for k in fields})
    candidate = LLM(**{k: getattr(candidate_args, k) for k in fields})
    return evaluate_offline(reference, candidate, prompts, args.greedy_tokens)


def _online(args: argparse.Namespace) -> EvalResult:
    from ladle.runtime.eval.online import Endpoint, evaluate_online

    prompts = load_prompts(args.prompts)[: args.max_prompts]
    return evaluate_online(
        Endpoint(args.reference_url, args.reference_model, args.api_key),
        Endpoint(args.candidate_url, args.candidate_model, args.api_key),
        prompts,
        top_k=args.top_k,
        greedy_tokens=args.greedy_tokens,
        protocol=args.protocol,
    )


def main(args: argparse.Namespace) -> int:
    from ladle.runtime.config import ConfigError
    from ladle.runtime.eval.online import EvalError

    if (args.reference_url is None) != (args.candidate_url is None):
        raise SystemExit("ladle eval: give both --reference-url and --candidate-url, or neither")
    if args.greedy_tokens < 1 or (args.max_prompts is not None and args.max_prompts < 1):
        raise SystemExit("ladle eval: --greedy-tokens and --max-prompts must be >= 1")
    try:
        result = _online(args) if args.reference_url else _offline(args)
    except (PromptFileError, ConfigError, EvalError, ValueError) as exc:
        print(f"ladle eval: {exc}", file=sys.stderr)
        return 2
    print(result.summary())
    if args.json:
        args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    if args.gate:
        failures = GATES[args.gate].failures(result)
        verdict = "passes" if not failures else "fails: " + "; ".join(failures)
        print(f"gate {args.gate} {verdict}")
        return 1 if failures else 0
    return 0
