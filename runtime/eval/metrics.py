"""The numbers of a quality comparison and how they are computed, in plain Python.

A candidate (a quantized variant) is compared with a reference (the full-precision model) on
the same text, teacher-forced: at every position both predict the next token of the text, so
their distributions are compared on identical contexts. Per position:

* **KL divergence** ``KL(reference || candidate)``, llama.cpp's direction. Offline it is summed
  over the whole vocabulary. An OpenAI endpoint returns only each position's top-k, so online
  it is the exact KL divergence of the two distributions *coarsened* to the tokens both sides
  report, plus one bucket holding everything else; by the data-processing inequality that
  never exceeds the full-vocabulary value, so a gate on it is never stricter than the truth
  (``topk_kld``).
* **top-1 agreement**: both put the same token first.
* **perplexity**: ``exp`` of the mean negative log-likelihood of the text's tokens, for each
  side, and its relative change.

And per prompt, **greedy agreement**: both continue the prompt with the same first N tokens.

Nothing here imports torch, so the online mode runs anywhere httpx does (the operator).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Hashable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ladle.words import plural

# A probability mass below this counts as zero in the coarsened KL divergence.
_EPS = 1e-12
# The largest argument of exp that a float holds the result of.
_LOG_MAX = math.log(sys.float_info.max)


@dataclass(frozen=True)
class EvalResult:
    """One comparison's numbers: small, typed, JSON-friendly."""

    mode: str  # "offline" or "online"
    kld_over: str  # "vocabulary" or "top-<k>"
    num_prompts: int
    num_tokens: int
    kld_mean: float
    kld_p99: float
    top1_agreement: float
    ppl_reference: float
    ppl_candidate: float
    ppl_delta: float  # ppl_candidate / ppl_reference - 1
    greedy_agreement: float
    greedy_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        return "\n".join(
            [
                f"prompts {self.num_prompts}, scored tokens {self.num_tokens} ({self.mode}, "
                f"KLD over the {self.kld_over})",
                f"  KLD mean         {self.kld_mean:.5f}  (p99 {self.kld_p99:.4f})",
                f"  top-1 agreement  {self.top1_agreement:.2%}",
                f"  perplexity       {self.ppl_reference:.3f} -> {self.ppl_candidate:.3f} "
                f"({self.ppl_delta:+.2%})",
                f"  greedy agreement {self.greedy_agreement:.2%} "
                f"(first {plural(self.greedy_tokens, 'token')} identical)",
            ]
        )


@dataclass(frozen=True)
class Gate:
    """Thresholds a candidate must meet; None: not gated."""

    name: str
    max_kld: float | None = None
    min_top1: float | None = None
    max_ppl_delta: float | None = None

    def failures(self, result: EvalResult) -> list[str]:
        failed = []
        if self.max_kld is not None and result.kld_mean > self.max_kld:
            failed.append(f"KLD {result.kld_mean:.5f} > {self.max_kld}")
        if self.min_top1 is not None and result.top1_agreement < self.min_top1:
            failed.append(f"top-1 agreement {result.top1_agreement:.2%} < {self.min_top1:.0%}")
        if self.max_ppl_delta is not None and result.ppl_delta > self.max_ppl_delta:
            failed.append(f"perplexity change {result.ppl_delta:+.2%} > +{self.max_ppl_delta:.0%}")
        return failed


# The gates the field uses for weight-only quantization against full precision; and one for a
# new version of a LoRA adapter against the old, which may well answer differently (that is
# why it was trained) but should not read the evaluation's text worse.
GATES = {
    "int8": Gate("int8", max_kld=0.005, min_top1=0.97),
    "int4": Gate("int4", min_top1=0.90, max_ppl_delta=0.05),
    "adapter": Gate("adapter", max_ppl_delta=0.10),
}


def _exp(x: float) -> float:
    """``math.exp``, infinite where it would overflow: a model that answers noise can read a
    text at a mean negative log-likelihood of thousands of nats a token."""
    return math.exp(x) if x < _LOG_MAX else math.inf


def topk_kld(reference: Mapping[Hashable, float], candidate: Mapping[Hashable, float]) -> float:
    """KL(reference || candidate) from two partial logprob maps (token -> logprob).

    The tokens both maps hold keep their probabilities; all other tokens (those neither side
    reported, and those only one side did) merge into one "rest" bucket on each side, whose
    mass is what the listed tokens leave. That is the exact divergence between coarsenings of
    the two full distributions, hence a lower bound on the full one.
    """
    common = reference.keys() & candidate.keys()
    kld = 0.0
    p_listed = q_listed = 0.0
    for token in common:
        p, q = math.exp(reference[token]), math.exp(candidate[token])
        p_listed += p
        q_listed += q
        if p > _EPS:
            kld += p * (reference[token] - max(candidate[token], math.log(_EPS)))
    p_rest, q_rest = max(1.0 - p_listed, 0.0), max(1.0 - q_listed, 0.0)
    if p_rest > _EPS:
        kld += p_rest * (math.log(p_rest) - math.log(max(q_rest, _EPS)))
    return max(kld, 0.0)


def top1(logprobs: Mapping[Hashable, float]) -> Hashable:
    return max(logprobs.items(), key=lambda item: item[1])[0]


@dataclass
class Accumulator:
    """Adds up per-position and per-prompt observations into an :class:`EvalResult`."""

    klds: list[float] = field(default_factory=list)
    top1_same: int = 0
    nll_reference: float = 0.0
    nll_candidate: float = 0.0
    greedy_same: int = 0
    prompts: int = 0

    def add_position(
        self, kld: float, same_top1: bool, nll_reference: float, nll_candidate: float
    ) -> None:
        self.klds.append(kld)
        self.top1_same += int(same_top1)
        self.nll_reference += nll_reference
        self.nll_candidate += nll_candidate

    def add_prompt(self, greedy_same: bool) -> None:
        self.prompts += 1
        self.greedy_same += int(greedy_same)

    def result(self, mode: str, kld_over: str, greedy_tokens: int) -> EvalResult:
        n = len(self.klds)
        if n == 0 or self.prompts == 0:
            raise ValueError("nothing was scored: every prompt needs at least two tokens")
        ordered = sorted(self.klds)
        ppl_ref = _exp(self.nll_reference / n)
        ppl_cand = _exp(self.nll_candidate / n)
        return EvalResult(
            mode=mode,
            kld_over=kld_over,
            num_prompts=self.prompts,
            num_tokens=n,
            kld_mean=sum(self.klds) / n,
            kld_p99=ordered[min(n - 1, math.ceil(0.99 * n) - 1)],
            top1_agreement=self.top1_same / n,
            ppl_reference=ppl_ref,
            ppl_candidate=ppl_cand,
            # From the difference of the logs: finite while the ratio is, however large both.
            ppl_delta=_exp((self.nll_candidate - self.nll_reference) / n) - 1.0,
            greedy_agreement=self.greedy_same / self.prompts,
            greedy_tokens=greedy_tokens,
        )
