"""What one request may ask of the engine: explicit, configurable caps with vLLM-like defaults.

The engine checks every request against these when it is admitted (offline and served alike),
so nothing one request asks for can grow a step's work or memory without bound. Only the
standard library is imported here: ``ladle --help`` reads the flags.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ladle.flag_types import integer
from ladle.runtime.config import ConfigError


@dataclass(frozen=True)
class RequestLimits:
    # vLLM's --max-logprobs: top-N per generated and per prompt token.
    max_logprobs: int = 20
    # Sequences per prompt: n, best_of and beam width (OpenAI caps n at 128). The engine also
    # refuses more than --max-num-seqs, which could never run together.
    max_n: int = 128
    # Prompts in one /v1/completions request.
    max_prompts: int = 256
    # Stop strings, and stop token ids, per request.
    max_stop: int = 64
    # Characters in one stop string or bad word.
    max_stop_length: int = 256
    # Entries in logit_bias (OpenAI's cap is 300).
    max_logit_bias: int = 300
    # Words in bad_words.
    max_bad_words: int = 128

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                flag = f.name.replace("_", "-")
                raise ConfigError(f"{flag} must be an integer >= 1; got {value!r}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("request limits (over-limit requests get a 400)")
        defaults = RequestLimits()
        helps = {
            "max_logprobs": "top logprobs per token (logprobs, prompt_logprobs, top_logprobs)",
            "max_n": "sequences per prompt: n, best_of, beam width",
            "max_prompts": "prompts in one completions request",
            "max_stop": "stop strings, and stop token ids, per request",
            "max_stop_length": "characters in one stop string or bad word",
            "max_logit_bias": "entries in logit_bias",
            "max_bad_words": "entries in bad_words",
        }
        for f in dataclasses.fields(RequestLimits):
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                type=integer(1),
                default=getattr(defaults, f.name),
                help=helps[f.name],
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLimits:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})
