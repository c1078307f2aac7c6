"""Outputs out: the scheduler's per-step reports become ``RequestOutput`` objects.

Each request keeps, per sequence, an incremental detokenizer (which also finds stop strings),
the logprobs in vLLM's shape, and how much was already handed out, so that ``DELTA`` outputs
carry exactly what is new. Stop strings end sequences here; the engine passes them to the
scheduler, as vLLM's output processor aborts them in the engine core. An n > 1 request is
a parent whose samples the scheduler runs as child requests (``parallel_sampling``): their
reports are gathered here into the parent's outputs, one sequence per child.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ladle.runtime.detokenizer import IncrementalDetokenizer
from ladle.runtime.errors import RequestError
from ladle.runtime.input_processor import Request
from ladle.runtime.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from ladle.runtime.parallel_sampling import ParentRequest
from ladle.runtime.sampler import TokenLogprobs
from ladle.runtime.sampling_params import RequestOutputKind
from ladle.runtime.scheduler_output import RequestUpdate, SequenceUpdate

log = logging.getLogger(__name__)


@dataclass
class _SeqOutput:
    """What one sequence has produced for its caller, and how much of it was already sent."""

    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cumulative_logprob: float | None = None
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_finish: bool = False


@dataclass
class _RequestState:
    request: Request
    metrics: RequestMetrics
    outs: dict[int, _SeqOutput] = field(default_factory=dict)
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int = 0
    finished: bool = False
    hypotheses: list[CompletionOutput] | None = None
    parent: ParentRequest | None = None

    def scheduled_ids(self) -> list[str]:
        """The ids the scheduler knows this request by (its children's, for a parent)."""
        if self.parent is None:
            return [self.request.request_id]
        return self.parent.child_ids()[: self.parent.started]


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    # Requests (as the scheduler knows them) that a stop string ended: the scheduler must
    # free them.
    stopped: list[str] = field(default_factory=list)
    # Requests (as the scheduler knows them) that failed here, with why: the scheduler must
    # free them.
    failed: dict[str, str] = field(default_factory=dict)
    # Children of n > 1 requests to hand to the scheduler now.
    started: list[Request] = field(default_factory=list)
    # Prompt tokens of requests that got their first token (vLLM counts them then, once).
    num_prompt_tokens: int = 0
    # Requests that ended without an error.
    num_finished: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestState] = {}
        # The children of n > 1 requests, by the id the scheduler knows them by: their
        # parent's state and their sample index.
        self._children: dict[str, tuple[_RequestState, int]] = {}
        self._token_text: dict[int, str] = {}

    def add_request(self, request: Request) -> list[Request]:
        """Take a request; returns what the scheduler runs for it now (itself, or the first
        child of an n > 1 request)."""
        state = _RequestState(request, RequestMetrics(request.arrival_time))
        fan_out = request.beam_params is None and request.params.num_samples > 1
        if fan_out:
            state.parent = ParentRequest(request)
        ids = [request.request_id, *(state.parent.child_ids() if state.parent else [])]
        taken = [i for i in ids if self.has_request(i)]
        if taken:
            raise RequestError(f"request id {taken[0]!r} is already in use")
        if request.beam_params is None and request.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self._requests[request.request_id] = state
        if state.parent is None:
            return [request]
        for index, child_id in enumerate(ids[1:]):
            self._children[child_id] = (state, index)
        return state.parent.start(1)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._children

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_unstarted(self) -> int:
        """Children of n > 1 requests that wait for their first sibling to sample. Read from
        the server's thread, so it works on a snapshot."""
        return sum(s.parent.num_unstarted for s in list(self._requests.values()) if s.parent)

    def end(self, request_ids: list[str], reason: str) -> tuple[list[str], list[RequestUpdate]]:
        """Requests to end (a child's id stands for its parent): the ids the scheduler knows
        them by, and the reports of the children it never saw, which end here."""
        scheduled: list[str] = []
        unstarted: list[RequestUpdate] = []
        for rid in request_ids:
            state = self._state(rid)[0]
            if state is None:
                continue
            scheduled += state.scheduled_ids()
            if state.parent is not None:
                unstarted += [
                    RequestUpdate(child, [SequenceUpdate(finish_reason=reason)], finished=True)
                    for child in state.parent.drop_unstarted()
                ]
        return list(dict.fromkeys(scheduled)), unstarted

    def _state(self, request_id: str) -> tuple[_RequestState | None, int]:
        """The state of a request, or of the parent of a child, and the sample's index."""
        child = self._children.get(request_id)
        if child is not None:
            return child
        return self._requests.get(request_id), 0

    def process(self, updates: list[RequestUpdate]) -> ProcessedOutputs:
        """Apply the reports; each request gives at most one output, whatever number of its
        samples reported."""
        now = time.monotonic()
        result = ProcessedOutputs()
        by_request: dict[str, tuple[_RequestState, list[tuple[int, RequestUpdate]]]] = {}
        for update in updates:
            state, index = self._state(update.request_id)
            if state is not None:
                by_request.setdefault(state.request.request_id, (state, []))[1].append(
                    (index, update)
                )
        for rid, (state, items) in by_request.items():
            error = next((u.error for _, u in items if u.error is not None), None)
            # One sample that failed fails its parent request as a whole.
            failure = error if state.parent is not None else None
            output = None
            if failure is None:
                try:
                    for index, update in items:
                        self._apply(state, index, update, now, result)
                    output = self._output(state)
                except Exception as exc:
                    log.exception("processing a step's output failed", extra={"request_id": rid})
                    failure = f"internal error while processing the output: {exc!r}"
            if failure is not None:
                result.failed.update(dict.fromkeys(state.scheduled_ids(), failure))
                output = self._failure(state, failure)
            if output is not None and error is not None:
                output.error = error
            if output is not None:
                result.outputs.append(output)
            if state.finished:
                self._forget(state)
                result.num_finished += output is None or output.error is None
            elif state.parent is not None and any(i == 0 and u.sampled for i, u in items):
                result.started += state.parent.start(state.parent.num_unstarted)
        return result

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.request.request_id]
        if state.parent is not None:
            state.parent.drop_unstarted()
            for child_id in state.parent.child_ids():
                del self._children[child_id]

    def _failure(self, state: _RequestState, message: str) -> RequestOutput:
        """The last output of a request that failed: what it had, finish reason "error"."""
        state.finished = True
        request = state.request
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
                for i in sorted(state.outs) or [0]
            ],
            finished=True,
            metrics=state.metrics,
            error=message,
        )

    # -- applying a report --------------------------------------------------------------

    def _apply(
        self,
        state: _RequestState,
        index: int,
        update: RequestUpdate,
        now: float,
        result: ProcessedOutputs,
    ) -> None:
        metrics = state.metrics
        if metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = update.first_scheduled_time
        if index == 0:
            state.num_cached_tokens = update.num_cached_tokens
        if update.prompt_logprobs is not None and state.prompt_logprobs is not None:
            first, lps = update.prompt_logprobs
            for offset, lp in enumerate(lps):
                state.prompt_logprobs[first + offset] = self._logprob_dict(lp)
        if update.sampled:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                result.num_prompt_tokens += len(state.request.prompt_token_ids)
            metrics.last_token_time = now
        for seq_update in update.seqs:
            if self._apply_seq(state, index, seq_update):
                result.stopped.append(update.request_id)
        if update.hypotheses is not None:
            state.hypotheses = [
                CompletionOutput(
                    index=i,
                    text=self._decode(h.token_ids),
                    token_ids=list(h.token_ids),
                    finish_reason=h.finish_reason,
                    cumulative_logprob=h.cumulative_logprob,
                )
                for i, h in enumerate(update.hypotheses)
            ]
        params = state.request.params
        state.finished = (update.finished and state.parent is None) or (
            state.request.beam_params is None
            and len(state.outs) == params.num_samples
            and all(o.finish_reason is not None for o in state.outs.values())
        )
        if state.finished:
            metrics.finished_time = time.monotonic()

    def _apply_seq(self, state: _RequestState, index: int, update: SequenceUpdate) -> bool:
        """Take one sequence's news; returns True when a stop string ended it here."""
        out = state.outs.get(index)
        if out is None:
            out = state.outs[index] = self._seq_output(state.request)
        if out.finish_reason is not None:
            return False
        params = state.request.params
        out.cumulative_logprob = update.cumulative_logprob
        if out.logprobs is not None:
            out.logprobs.extend(self._logprob_dict(lp) for lp in update.logprobs)
        ended = update.finish_reason is not None
        out.finish_reason, out.stop_reason = update.finish_reason, update.stop_reason
        if not update.token_ids:
            if ended:
                out.detokenizer.update([], final=True, check_stop=False)
            return False
        out.token_ids.extend(update.token_ids)
        by_token = update.finish_reason == "stop"
        stop = out.detokenizer.update(
            [] if by_token and not params.include_stop_str_in_output else update.token_ids,
            final=ended,
            check_stop=not by_token and len(out.token_ids) >= params.min_tokens,
        )
        if stop is None:
            return False
        out.finish_reason, out.stop_reason = "stop", stop
        return not ended

    def _seq_output(self, request: Request) -> _SeqOutput:
        params = request.params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        return _SeqOutput(detokenizer, [] if params.logprobs is not None else None)

    # -- building outputs ---------------------------------------------------------------

    def _output(self, state: _RequestState) -> RequestOutput | None:
        request = state.request
        params = request.params
        kind = params.output_kind
        done = state.finished
        if request.beam_params is not None:
            completions = state.hypotheses if done else None
        elif done or (kind is not RequestOutputKind.FINAL_ONLY and params.num_samples == params.n):
            completions = self._completions(state, kind is RequestOutputKind.DELTA)
        else:
            completions = None
        if completions is None:
            return None
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None and kind is RequestOutputKind.DELTA:
            ready = state.metrics.first_token_time is not None
            prompt_logprobs = prompt_logprobs if ready and not state.prompt_logprobs_sent else None
            state.prompt_logprobs_sent = state.prompt_logprobs_sent or ready
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=done,
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _completions(self, state: _RequestState, delta: bool) -> list[CompletionOutput]:
        """Each sequence's output so far (or, with ``delta``, what changed since the last call).
        With best_of > n, only the n with the highest cumulative logprob, ranked, at the end."""
        params = state.request.params
        outs = [state.outs[i] for i in sorted(state.outs)]
        if params.num_samples > params.n:
            outs.sort(key=lambda o: o.cumulative_logprob or 0.0, reverse=True)
            outs = outs[: params.n]
        completions = []
        for index, out in enumerate(outs):
            ended = out.finish_reason is not None
            text = out.detokenizer.output_text(ended)
            tokens, logprobs = out.token_ids, out.logprobs
            if delta:
                if not (len(text) > out.sent_chars or len(tokens) > out.sent_tokens) and (
                    out.sent_finish or not ended
                ):
                    continue
                text, tokens = text[out.sent_chars :], tokens[out.sent_tokens :]
                logprobs = None if logprobs is None else logprobs[out.sent_tokens :]
                out.sent_chars += len(text)
                out.sent_tokens += len(tokens)
                out.sent_finish = ended
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(tokens),
                    finish_reason=out.finish_reason,
                    stop_reason=out.stop_reason,
                    cumulative_logprob=out.cumulative_logprob,
                    logprobs=None if logprobs is None else list(logprobs),
                )
            )
        return completions

    # -- token text ---------------------------------------------------------------------

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's per-position shape: the chosen token first, then the top-N by rank."""
        assert lp.logprob is not None, "the sampler computes logprobs where they are asked for"
        ids = [lp.token_id, *lp.top_token_ids]
        texts = self._decode_tokens(ids)
        result = {lp.token_id: Logprob(lp.logprob, lp.rank, texts[0])}
        for rank, (token, value, text) in enumerate(
            zip(lp.top_token_ids, lp.top_logprobs, texts[1:], strict=True), start=1
        ):
            result.setdefault(token, Logprob(value, rank, text))
        return result

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    def _decode_tokens(self, ids: list[int]) -> list[str]:
        """Each token decoded on its own (vLLM's ``decoded_token``), cached per token id."""
        missing = [t for t in ids if t not in self._token_text]
        if missing:
            texts: list[str] = self.tokenizer.batch_decode([[t] for t in missing])
            self._token_text.update(zip(missing, texts, strict=True))
        return [self._token_text[t] for t in ids]
