"""What the engine hands back, shaped like vLLM's ``RequestOutput``.

Logprobs use vLLM's shape, which maps one to one onto OpenAI's ``logprobs`` objects: position
``i`` of ``CompletionOutput.logprobs`` is a dict from token id to :class:`Logprob` holding the
sampled token ``token_ids[i]`` (first) and the top-N alternatives. For chat, ``content[i]`` is
``{token: lp[t].decoded_token, logprob: lp[t].logprob, bytes: list(decoded.encode()),
top_logprobs: the other entries ordered by rank}`` with ``t = token_ids[i]``; for completions,
``tokens``, ``token_logprobs`` and ``top_logprobs`` are read the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """A token's log-probability under the model's raw distribution (before penalties,
    temperature and filters, as vLLM reports by default)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
# The first prompt token has no logprob: nothing precedes it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.monotonic``) used for TTFT, queue time and latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class CompletionOutput:
    """One sequence of a request (``index`` among the ``n``).

    ``finish_reason`` is ``stop``, ``length``, ``abort`` (aborted, or past its deadline) or
    ``error`` (failed inside the engine; the request's ``error`` says why). For ``stop``,
    ``stop_reason`` is the stop string or stop token id that ended it (None for EOS).
    ``cumulative_logprob`` sums the raw logprobs of ``token_ids`` when they were computed (the
    request asked for logprobs, or best_of ranks by them), else it is None; ``logprobs`` is set
    when the request asked for them.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's state after a step.

    With ``delta`` outputs (streaming), ``text``, ``token_ids`` and ``logprobs`` hold only what
    is new since the previous output, ``outputs`` only the sequences that changed, and
    ``prompt_logprobs`` comes once; otherwise they are cumulative.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    extra: dict[str, object] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    # Set when the request failed inside the engine (finish reason "error"): why.
    error: str | None = None
