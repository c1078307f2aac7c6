"""Per-request sampling settings, shaped like vLLM's ``SamplingParams`` and ``BeamSearchParams``.

Every field is checked on construction, so a bad request fails with a message that names the
parameter and its range before it reaches the scheduler. Token-level data that needs the
tokenizer (stop token ids including EOS, bad words as token ids) is added by
:meth:`SamplingParams.bind`, which the engine calls once per request.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any, Literal

from ladle.runtime.errors import RequestError, require_text

_GREEDY_EPS = 1e-5
# OpenAI's documented ranges.
_MAX_PENALTY = 2.0
_MAX_LOGIT_BIAS = 100.0


class RequestOutputKind(enum.Enum):
    """What each output carries: everything so far, only what is new, or only the end."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


class SamplingParamsError(RequestError):
    """A sampling parameter is out of range; the message names it and its range."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}", param)


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(param, message)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value: object, param: str, low: int, what: str) -> None:
    _require(_is_int(value) and value >= low, param, f"{what}, got {value!r}")  # type: ignore[operator]


def _check_token_ids(ids: object, param: str) -> None:
    _require(
        isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids),
        param,
        "must be a list of token ids >= 0",
    )


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop (vLLM's fields, names and defaults).

    ``temperature=0`` is greedy. ``top_k`` 0 or -1 and ``top_p`` 1 disable those filters.
    Penalties follow vLLM: ``repetition_penalty`` (HF/CTRL) divides positive and multiplies
    negative logits of every token seen in the prompt or output; ``presence_penalty`` and
    ``frequency_penalty`` (OpenAI) subtract from logits of tokens seen in the output only.
    ``stop`` accepts one string or a list, as in vLLM.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by bind(): the tokens min_tokens suppresses, and bad words as token-id sequences.
    all_stop_token_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters cannot change the argmax, so drop them to keep the batch cheap.
            self.temperature, self.top_p, self.top_k, self.min_p = 0.0, 1.0, 0, 0.0

    def _normalize(self) -> None:
        stop: object = self.stop
        if stop is None:
            self.stop = []
        elif isinstance(stop, str):
            self.stop = [stop]
        else:
            self.stop = list(self.stop)
        for name in ("stop_token_ids", "bad_words"):
            if getattr(self, name) is None:
                setattr(self, name, [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            # OpenAI clients send JSON objects, whose keys are strings.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise SamplingParamsError(
                    "logit_bias", "must map token ids to numbers in [-100, 100]"
                ) from None

    def _validate(self) -> None:
        _check_int(self.n, "n", 1, "must be an integer >= 1")
        if self.best_of is not None:
            _check_int(self.best_of, "best_of", self.n, f"must be an integer >= n ({self.n})")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(
                -_MAX_PENALTY <= value <= _MAX_PENALTY, name, f"must be in [-2, 2], got {value}"
            )
        _require(
            0 < self.repetition_penalty < math.inf,
            "repetition_penalty",
            f"must be > 0 (1 disables it), got {self.repetition_penalty}",
        )
        _require(
            0 <= self.temperature < math.inf,
            "temperature",
            f"must be >= 0 (0 is greedy), got {self.temperature}",
        )
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int(self.top_k, "top_k", 0, "must be -1 or 0 (disabled) or an integer >= 1")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _require(
                _is_int(self.seed) and 0 <= self.seed < 2**63,
                "seed",
                f"must be an integer in [0, 2**63), got {self.seed!r}",
            )
            # Sample i of n (or best_of) draws from seed + i.
            last = self.seed + self.num_samples - 1
            _require(
                last < 2**63,
                "seed",
                f"seed + {self.num_samples - 1} (one seed per sample) must be < 2**63, "
                f"got {self.seed!r}",
            )
        _require(
            all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "must be non-empty strings",
        )
        for name in ("stop", "bad_words"):
            for text in getattr(self, name):
                if isinstance(text, str):
                    require_text(text, name)
        _check_token_ids(self.stop_token_ids, "stop_token_ids")
        _require(
            all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words",
            "must be non-empty strings",
        )
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", 1, "must be an integer >= 1")
        _check_int(self.min_tokens, "min_tokens", 0, "must be an integer >= 0")
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(value, name, 0, "must be an integer >= 0")
        if self.logit_bias is not None:
            for token, bias in self.logit_bias.items():
                _require(token >= 0, "logit_bias", f"token ids must be >= 0, got {token}")
                _require(
                    -_MAX_LOGIT_BIAS <= bias <= _MAX_LOGIT_BIAS,
                    "logit_bias",
                    f"biases must be in [-100, 100], got {bias} for token {token}",
                )
        if self.allowed_token_ids is not None:
            _check_token_ids(self.allowed_token_ids, "allowed_token_ids")
            _require(bool(self.allowed_token_ids), "allowed_token_ids", "must not be empty")
        _require(
            isinstance(self.output_kind, RequestOutputKind),
            "output_kind",
            f"must be a RequestOutputKind, got {self.output_kind!r}",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """How many sequences run: ``best_of`` if set, else ``n``."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def needs_logprob(self) -> bool:
        """Whether the sampled token's logprob is used: reported, or ranking best_of."""
        return self.logprobs is not None or self.num_samples > self.n

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy; the bound token data is carried over."""
        copy = dataclasses.replace(self, **changes)
        copy.all_stop_token_ids = self.all_stop_token_ids
        copy.bad_words_token_ids = self.bad_words_token_ids
        return copy

    def bind(self, tokenizer: Any, eos_token_ids: set[int], vocab_size: int) -> SamplingParams:
        """A copy with the tokenizer-dependent data filled in, its token ids checked against
        the vocabulary."""
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name) or []
            _require(all(t < vocab_size for t in ids), name, f"token ids must be < {vocab_size}")
        if self.logit_bias:
            bad = [t for t in self.logit_bias if t >= vocab_size]
            _require(not bad, "logit_bias", f"token ids must be < {vocab_size}, got {bad[:3]}")
        bound = self.clone()
        stop_ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            stop_ids |= eos_token_ids
        bound.all_stop_token_ids = frozenset(stop_ids)
        bound.bad_words_token_ids = _bad_words_token_ids(tokenizer, self.bad_words)
        return bound


def _bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word is banned as tokenized at the start of the text and, when that
    differs in its first token only, also as tokenized after a space."""
    result: list[list[int]] = []
    for word in words:
        plain: list[int] = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced: list[int] = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        result.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            result.append(spaced)
    return result


EarlyStopping = bool | Literal["never"]


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` plus transformers' ``early_stopping``.

    The search itself follows transformers' ``generate(num_beams=beam_width, do_sample=False)``,
    so ``length_penalty`` and ``early_stopping`` mean what they mean there.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False

    def __post_init__(self) -> None:
        _check_int(self.beam_width, "beam_width", 1, "must be an integer >= 1")
        _check_int(self.max_tokens, "max_tokens", 1, "must be an integer >= 1")
        _require(
            math.isfinite(self.length_penalty),
            "length_penalty",
            f"must be a finite number, got {self.length_penalty}",
        )
        _require(
            self.early_stopping in (True, False, "never"),
            "early_stopping",
            f"must be true, false or 'never', got {self.early_stopping!r}",
        )
