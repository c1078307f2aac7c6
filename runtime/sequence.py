"""Sequences, the unit the scheduler schedules and the KV cache manager allocates for, and the
groups that tie one request's sequences together (one, or a beam search's beams)."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ladle.runtime.beam_search import BeamCandidates, BeamHypothesis, BeamSearch
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ladle.runtime.sampler import TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # A beam that has sampled this round: it keeps its blocks but is not scheduled until its
    # siblings have sampled too.
    PARKED = "parked"
    FINISHED = "finished"


_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    """Token ids plus how many of them have their KV in the cache.

    ``num_computed_tokens`` trails ``len(token_ids)`` by the prompt while prefilling and by one
    token while decoding: a sampled token's KV is written by the next step.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    output_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # The most tokens ever computed at once: recomputation below it is not progress.
    computed_high: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float = 0.0
    # Chained content hashes of the full blocks seen so far, for prefix caching.
    block_hashes: list[bytes] = field(default_factory=list)
    # This sequence's random stream: the request's seed (plus the sample's index for n > 1).
    seed: int | None = None
    # The adapter that runs on top of the base model, if any, and the schedules that passed
    # it over for want of a free adapter slot.
    lora: LoRARequest | None = None
    lora_passes: int = 0
    # Speculative decoding: drafts rejected in a row, and decode steps to go without one.
    draft_misses: int = 0
    draft_pause: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.seed is None:
            self.seed = self.params.seed

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def fork(self) -> Sequence:
        """A beam that runs on from every token so far, sharing this one's KV blocks (the
        caller forks them in the cache)."""
        child = Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.params,
            self.arrival_time,
            self.priority,
            lora=self.lora,
        )
        child.token_ids = list(self.token_ids)
        child.output_token_ids = list(self.output_token_ids)
        child.computed_high = self.computed_high
        child.num_cached_tokens = self.num_cached_tokens
        return child

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: the KV is dropped, the tokens are kept."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        self.num_preemptions += 1


@dataclass
class BeamRound:
    """What one beam-search round changed, for the scheduler to apply to the KV cache and
    its queues."""

    done: bool
    dropped: list[Sequence]
    running: list[Sequence] = field(default_factory=list)
    # (parent, child): each child shares its parent's blocks.
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)


@dataclass(eq=False)
class SequenceGroup:
    """One request as the scheduler sees it: one sequence, or a beam search's.

    Beam searches fork into ``beam_width`` live beams; ``seqs`` holds the live ones and
    ``beam`` decides which run on.
    """

    request_id: str
    params: SamplingParams
    seqs: list[Sequence]
    # How many sequences the request runs at once (its beams); the scheduler reserves them at
    # admission.
    width: int = 1
    deadline: float | None = None
    beam: BeamSearch | None = None
    # Beam search: this round's sample of each live beam, by seq_id.
    pending: dict[int, TokenLogprobs] = field(default_factory=dict)
    forked: bool = False
    first_scheduled_time: float | None = None

    @property
    def live(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.is_finished]

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def num_unforked(self) -> int:
        """Sequences the request will still fork: seats the scheduler keeps for them."""
        return 0 if self.forked else self.width - 1

    def step_beams(self) -> BeamRound | None:
        """One beam-search round, or None while a live beam has yet to sample.

        Beams that sampled are parked (keeping their blocks) until the others have too, so
        that siblings that missed a step (out of token budget, or preempted) catch up without
        competing with them. A parent chosen more than once runs on itself and forks a
        child for each other continuation; the group lists the forks at once, so that an
        abort from here on frees them too."""
        assert self.beam is not None
        beams = self.live
        if any(b.seq_id not in self.pending for b in beams):
            return None
        samples = [self.pending.pop(b.seq_id) for b in beams]
        continuations = self.beam.step(
            [
                BeamCandidates(
                    b.output_token_ids, b.cumulative_logprob, s.top_token_ids, s.top_logprobs
                )
                for b, s in zip(beams, samples, strict=True)
            ]
        )
        self.forked = True
        if self.beam.done:
            for b in beams:
                b.finish_reason = "length"
            return BeamRound(done=True, dropped=beams)
        running: list[Sequence] = []
        forks: list[tuple[Sequence, Sequence]] = []
        chosen: set[int] = set()
        for c in continuations:
            parent = beams[c.parent]
            if c.parent in chosen:
                child = parent.fork()
                forks.append((parent, child))
                running.append(child)
            else:
                chosen.add(c.parent)
                running.append(parent)
        for seq, c in zip(running, continuations, strict=True):
            seq.append_token(c.token_id)
            seq.cumulative_logprob = c.cumulative_logprob
        self.seqs = running
        dropped = [b for i, b in enumerate(beams) if i not in chosen]
        return BeamRound(done=False, dropped=dropped, running=running, forks=forks)

    def beam_results(self, reason: str) -> list[BeamHypothesis]:
        """The finished hypotheses, best first; a search that did not finish (ended by
        ``reason``) reports its live beams."""
        assert self.beam is not None
        if self.beam.done:
            return list(self.beam.finished)
        return [
            BeamHypothesis(list(b.output_token_ids), b.cumulative_logprob, 0.0, reason)
            for b in self.seqs
        ]
