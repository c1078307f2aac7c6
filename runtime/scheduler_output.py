"""What the scheduler hands on: the step to run (``SchedulerOutput``, to the model runner) and
what a step changed for each request (``RequestUpdate``, to the output processor), as vLLM
v1's ``sched/output.py`` and ``EngineCoreOutput``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ladle.runtime.beam_search import BeamHypothesis
from ladle.runtime.sampler import TokenLogprobs
from ladle.runtime.sequence import Sequence

# A draft slot that the model runner's drafter fills before the step runs (speculative method
# draft_model: the scheduler reserves room for the draft, the draft model writes it).
DRAFT_PENDING = -1


@dataclass
class ScheduledSequence:
    seq: Sequence
    # Tokens this step computes: the sequence's own, then ``draft`` (speculative decoding's
    # proposed continuation, which the step verifies).
    num_new_tokens: int
    draft: list[int] = field(default_factory=list)

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the last known token, so a new token gets sampled."""
        own = self.num_new_tokens - len(self.draft)
        return self.seq.num_computed_tokens + own == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences freed since the previous schedule: the model runner drops their state.
    finished_seq_ids: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SequenceUpdate:
    """What a request's sequence gained in a step: its new token (with the sample's
    logprobs), or its end."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestUpdate:
    """The scheduler's report on one request after a step (vLLM's ``EngineCoreOutput``)."""

    request_id: str
    seqs: list[SequenceUpdate] = field(default_factory=list)
    # Prompt logprobs of positions first, first + 1, ... that this step computed.
    prompt_logprobs: tuple[int, list[TokenLogprobs]] | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    # Whether any of its sequences sampled a token in the step (beams included).
    sampled: bool = False
    finished: bool = False
    # Beam search, once finished: the hypotheses, best first (an aborted search: its beams).
    hypotheses: list[BeamHypothesis] | None = None
    # Set when the request failed inside the engine; it is finished, its blocks freed.
    error: str | None = None
