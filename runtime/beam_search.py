"""Beam search, step by step, exactly as transformers' ``generate(num_beams=W, do_sample=False)``.

The engine owns the beams: each is a sequence whose KV blocks are shared copy-on-write with its
siblings, and whose raw log-probabilities the sampler reports (top ``num_candidates``). This
class only decides which continuations live on, following transformers' vectorized beam search
(``GenerationMixin._beam_search``) step for step, in fp32 like it:

- keep the top ``max(2, 1 + #eos) * W`` continuations over all beams by cumulative logprob;
- of those, the best W that do not end in EOS (or reach ``max_tokens``) run on;
- an EOS continuation among the first W becomes a finished hypothesis scored
  ``cumulative logprob / generated_length ** length_penalty`` (EOS counted), and the best W
  hypotheses are kept;
- ``early_stopping=True`` ends once W hypotheses exist; ``False`` ends when the best running beam,
  scored at its current length, cannot beat the worst kept hypothesis; ``"never"`` scores it at
  ``max_tokens`` when ``length_penalty > 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ladle.runtime.sampling_params import BeamSearchParams

# transformers marks impossible scores with -1e9.
_UNREACHABLE = -1.0e9


@dataclass
class BeamHypothesis:
    """A finished beam: generated tokens (EOS included) and its scores."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    finish_reason: str


@dataclass
class BeamCandidates:
    """One live beam's state as the step found it."""

    token_ids: list[int]
    cumulative_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class Continuation:
    """A beam that runs on: ``parent`` (its index among the live beams) extended by a token."""

    parent: int
    token_id: int
    cumulative_logprob: float


@dataclass
class BeamSearch:
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    finished: list[BeamHypothesis] = field(default_factory=list)
    num_generated: int = 0
    improvable: bool = True
    done: bool = False

    def __post_init__(self) -> None:
        if self.params.ignore_eos:
            self.eos_token_ids = frozenset()

    @property
    def num_candidates(self) -> int:
        """How many continuations each step keeps (and so the top-N each beam must report)."""
        return max(2, 1 + len(self.eos_token_ids)) * self.params.beam_width

    @property
    def _full(self) -> bool:
        return len(self.finished) == self.params.beam_width

    def step(self, beams: list[BeamCandidates]) -> list[Continuation]:
        """Advance by one token; returns the beams that run on (none once the search is done)."""
        width = self.params.beam_width
        k = self.num_candidates
        running_scores = torch.tensor([b.cumulative_logprob for b in beams], dtype=torch.float32)
        top = torch.tensor([b.top_logprobs for b in beams], dtype=torch.float32)
        flat = (top + running_scores[:, None]).flatten()
        scores, picks = flat.topk(min(k, flat.numel()))
        candidates = [
            Continuation(p // k, beams[p // k].top_token_ids[p % k], s)
            for p, s in zip(picks.tolist(), scores.tolist(), strict=True)
        ]
        length = self.num_generated + 1
        at_limit = length >= self.max_tokens
        hits = [at_limit or c.token_id in self.eos_token_ids for c in candidates]
        running = [c for c, hit in zip(candidates, hits, strict=True) if not hit][:width]

        # Only the first W candidates may finish; the rest are spares to keep W beams running.
        # (transformers also blocks additions once the search cannot improve or, with
        # early_stopping=True, is full; for one prompt the search has then already ended.)
        penalized = (scores / float(length**self.params.length_penalty)).tolist()
        for j in range(min(width, len(candidates))):
            if hits[j]:
                c = candidates[j]
                self.finished.append(
                    BeamHypothesis(
                        [*beams[c.parent].token_ids, c.token_id],
                        c.cumulative_logprob,
                        penalized[j],
                        "stop" if c.token_id in self.eos_token_ids else "length",
                    )
                )
        self.finished.sort(key=lambda h: h.score, reverse=True)
        del self.finished[width:]

        self.num_generated = length
        if running:
            self.improvable = self._can_improve(running[0].cumulative_logprob)
        self.done = (
            not self.improvable or (self.params.early_stopping is True and self._full) or all(hits)
        )
        return [] if self.done else running

    def _can_improve(self, best_running: float) -> bool:
        """transformers' early-stop heuristic: can the best running beam still beat the worst
        kept hypothesis?"""
        penalty = self.params.length_penalty
        if self.params.early_stopping == "never" and penalty > 0.0:
            length = self.max_tokens
        else:
            length = self.num_generated
        best = torch.tensor(best_running, dtype=torch.float32) / float(length**penalty)
        worst = min(h.score for h in self.finished) if self._full else _UNREACHABLE
        return bool(best > worst)


@dataclass
class BeamSearchSequence:
    """vLLM's shape: ``tokens`` holds the prompt and the generated tokens; ``text`` only the
    generated ones, without the final EOS."""

    tokens: list[int]
    text: str
    cum_logprob: float
    finish_reason: str
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best ``beam_width`` hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]
