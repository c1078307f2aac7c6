"""Continuous batching: which sequences run this step, and what a step's output changes.

One token budget covers prefill chunks and decodes alike, so long prompts are chunked and
share steps with running decodes. When blocks run out, the lowest-priority sequence (the
newest, under FCFS) is preempted and later recomputed; under the priority policy, so is one
of a lower priority when a more urgent request finds every seat taken.

Every admitted request eventually runs alone if it must, so none waits for ever: the input
processor refuses what could not fit in the whole cache (one sequence up to max_model_len,
or all of a beam search's beams), a beam search takes seats under ``max_num_seqs`` for every
beam it will fork, and beams parked while their siblings catch up are preempted like
running sequences (a waiting request may evict those of later requests too), so parked blocks
never wait on a sequence that waits on them.

As in vLLM v1, the scheduler is the one place where scheduling state changes after a step:
:meth:`Scheduler.update_from_output` advances computed tokens, appends sampled tokens, checks
the token-level stop conditions, forks beams, and frees what finished. Stop strings are found
by the output processor, which asks for those requests to be finished through
:meth:`Scheduler.finish_stopped`, as it would abort a request. An n > 1 request reaches the
scheduler as one request per sample (``parallel_sampling``).
"""

from __future__ import annotations

import bisect
import heapq
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ladle.runtime.beam_search import BeamSearch
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.lora.admission import AdapterAdmission
from ladle.runtime.sampler import TokenLogprobs
from ladle.runtime.scheduler_output import (
    RequestUpdate,
    ScheduledSequence,
    SchedulerOutput,
    SequenceUpdate,
)
from ladle.runtime.sequence import Sequence, SequenceGroup, SequenceStatus
from ladle.runtime.spec_decode.config import SpeculativeConfig
from ladle.runtime.spec_decode.drafting import Drafting

if TYPE_CHECKING:
    from ladle.runtime.input_processor import Request
    from ladle.runtime.model_runner import ModelRunnerOutput

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        max_model_len: int | None = None,
        eos_token_ids: Iterable[int] = (),
        max_loras: int | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.kv = kv
        self.drafting = Drafting(speculative)
        # Distinct adapters that may run at once (the device slots); None without LoRA.
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        # Beams that sampled this round and wait, with their blocks, for their siblings.
        self.parked: list[Sequence] = []
        self.groups: dict[str, SequenceGroup] = {}
        self.num_preemptions = 0
        # Tokens computed for the first time plus tokens sampled, over the scheduler's life:
        # the engine's progress watchdog reads it (recomputation after preemption is not
        # progress).
        self.progress = 0
        self._freed: list[int] = []
        self._deadlines: list[tuple[float, str]] = []

    # -- requests -----------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.groups:
            raise ValueError(f"request id {request.request_id!r} is already scheduled")
        seed = request.params.seed
        seq = Sequence(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.arrival_time,
            request.priority,
            lora=request.lora_request,
            seed=None if seed is None else seed + request.sample_index,
        )
        group = SequenceGroup(request.request_id, request.params, [seq], deadline=request.deadline)
        if request.beam_params is not None:
            bp = request.beam_params
            room = bp.max_tokens
            if self.max_model_len is not None:
                room = min(room, self.max_model_len - len(request.prompt_token_ids))
            group.beam = BeamSearch(bp, self.eos_token_ids, max(room, 1))
            group.width = bp.beam_width
        self.groups[request.request_id] = group
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
        self.add(seq)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._rank)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a forked beam that already has blocks, or take a parked beam back."""
        if seq.status is SequenceStatus.PARKED:
            self.parked.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def _park(self, seq: Sequence) -> None:
        """Stop scheduling a running beam but keep its blocks until its siblings sampled."""
        self.running.remove(seq)
        seq.status = SequenceStatus.PARKED
        self.parked.append(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.parked)

    @property
    def num_waiting_seqs(self) -> int:
        """Sequences waiting to be scheduled, counting the beams waiting searches will fork.
        Read by the server's admission and metrics from their own thread, so it works on a
        snapshot and tolerates a request that ends meanwhile."""
        total = 0
        for seq in list(self.waiting):
            group = self.groups.get(seq.request_id)
            total += 1 if group is None or group.forked else group.width
        return total

    def _seats_in_use(self) -> int:
        """Sequences admitted, counting the beams their searches have yet to fork."""
        unforked = {s.request_id for s in self.running if not self.groups[s.request_id].forked}
        reserved = sum(self.groups[rid].num_unforked for rid in unforked)
        return len(self.running) + len(self.parked) + reserved

    def _rank(self, seq: Sequence) -> tuple[int, float, int]:
        """Lower ranks are served first; the highest-ranked running sequence is preempted."""
        if self.policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (0, seq.arrival_time, seq.seq_id)

    # -- ending -------------------------------------------------------------------------

    def finish(self, seqs: Iterable[Sequence]) -> None:
        """Drop finished or aborted sequences and free their blocks at once."""
        gone = set()
        for seq in seqs:
            seq.status = SequenceStatus.FINISHED
            self.kv.free(seq)
            gone.add(seq.seq_id)
        if gone:
            self.running = [s for s in self.running if s.seq_id not in gone]
            self.waiting = [s for s in self.waiting if s.seq_id not in gone]
            self.parked = [s for s in self.parked if s.seq_id not in gone]
            self._freed.extend(gone)

    def finish_stopped(self, request_id: str) -> None:
        """End a request that the output processor stopped (a stop string matched)."""
        group = self.groups.get(request_id)
        if group is None:
            return
        for seq in group.live:
            seq.finish_reason = "stop"
        self.finish(group.live)
        self._drop_if_done(group)

    def finish_requests(
        self, request_ids: Iterable[str], reason: str, error: str | None = None
    ) -> list[RequestUpdate]:
        """End whole requests now (abort, deadline, failure), freeing their blocks; returns
        their last reports."""
        updates = []
        for rid in request_ids:
            group = self.groups.get(rid)
            if group is None:
                continue
            live = group.live
            for seq in live:
                seq.finish_reason = reason
            # A request that failed midway may have queued sequences its group does not list
            # yet (a fork interrupted): sweep the queues too, so nothing of it stays behind.
            listed = {s.seq_id for s in live}
            strays = [
                s
                for s in (*self.running, *self.parked, *self.waiting)
                if s.request_id == rid and s.seq_id not in listed
            ]
            self.finish([*live, *strays])
            update = RequestUpdate(rid, finished=True, error=error)
            if group.beam is not None:
                update.hypotheses = group.beam_results(reason)
            else:
                update.seqs = [
                    SequenceUpdate(
                        finish_reason=reason,
                        cumulative_logprob=s.cumulative_logprob if s.params.needs_logprob else None,
                    )
                    for s in live
                ]
            del self.groups[rid]
            updates.append(update)
        return updates

    def expire(self, now: float) -> list[str]:
        """Requests whose deadline has passed (still unfinished), for the engine to end."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, rid = heapq.heappop(self._deadlines)
            if rid in self.groups:
                expired.append(rid)
        return expired

    def _drop_if_done(self, group: SequenceGroup) -> bool:
        if group.finished and group.request_id in self.groups:
            del self.groups[group.request_id]
            return True
        return False

    # -- scheduling ---------------------------------------------------------------------

    def _preempt(self, victim: Sequence) -> None:
        """Free the victim's blocks and queue it for recomputation (its tokens are kept). A
        parked beam also drops its pending sample: it samples again once recomputed."""
        if victim.status is SequenceStatus.PARKED:
            self.parked.remove(victim)
            self.groups[victim.request_id].pending.pop(victim.seq_id, None)
        else:
            self.running.remove(victim)
        self.kv.free(victim)
        victim.reset_for_recompute()
        self.add(victim)
        self.num_preemptions += 1

    def _evict(
        self, victim: Sequence, out: SchedulerOutput, scheduled: dict[int, ScheduledSequence]
    ) -> int:
        """Preempt ``victim``, taking it out of this step; returns the tokens refunded."""
        self._preempt(victim)
        out.preempted.append(victim)
        undone = scheduled.pop(victim.seq_id, None)
        if undone is None:
            return 0
        out.scheduled.remove(undone)
        return undone.num_new_tokens

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[int, ScheduledSequence] = {}

        # Running sequences first, in admission order; everything before index i is scheduled.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # A decode verifies draft tokens in the same step where there is room for them
            # (their blocks included: without, it decodes one token as usual).
            group = self.groups[seq.request_id]
            draft = self.drafting.draft(seq, group, num_new, budget, self.max_model_len)
            later = len(self.running) - i - 1
            if (
                draft
                and self.drafting.fits(self.kv, seq, num_new, len(draft), later)
                and self.kv.allocate_slots(seq, num_new + len(draft))
            ):
                num_new += len(draft)
            else:
                draft = []
            while not self.kv.allocate_slots(seq, num_new):
                others_parked = [p for p in self.parked if p.request_id != seq.request_id]
                victim = max([*self.running, *others_parked], key=self._rank)
                was_scheduled = victim.seq_id in scheduled
                budget += self._evict(victim, out, scheduled)
                i -= int(was_scheduled)
                if victim is seq:
                    break
            else:
                item = ScheduledSequence(seq, num_new, draft)
                out.scheduled.append(item)
                scheduled[seq.seq_id] = item
                budget -= num_new
                i += 1

        # A step that had to preempt running work admits nothing new; one whose adapter finds
        # no free slot lets those behind it go first, for a while (lora/admission).
        blocked = bool(out.preempted)
        head = 0
        adapters = AdapterAdmission(self.max_loras, (*self.running, *self.parked))
        while head < len(self.waiting) and budget > 0 and not blocked:
            seq = self.waiting[head]
            if adapters.passes_over(seq):
                head += 1
                continue
            group = self.groups[seq.request_id]
            seats = group.width if not group.forked else 1
            if self._seats_in_use() + seats > self.max_num_seqs:
                seat = self._seat_for(seq)
                if seat is None:
                    break
                budget += self._evict(seat, out, scheduled)
                continue
            cached = self.kv.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.allocate_slots(seq, num_new, cached):
                evict = self._victim_for(seq)
                if evict is None:
                    break
                budget += self._evict(evict, out, scheduled)
                continue
            self.waiting.pop(head)
            adapters.admit(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            item = ScheduledSequence(seq, num_new)
            out.scheduled.append(item)
            scheduled[seq.seq_id] = item
            budget -= num_new

        out.block_copies = self.kv.take_pending_copies()
        self._stamp(out)
        return out

    def _victim_for(self, seq: Sequence) -> Sequence | None:
        """Whom the waiting head may evict to get blocks: parked beams of later requests
        (their group waits behind the head, so they would hold their blocks for nothing) and,
        under the priority policy, any less urgent running sequence."""
        candidates = [p for p in self.parked if p.request_id != seq.request_id]
        if self.policy == "priority":
            candidates += self.running
        later = [c for c in candidates if self._rank(c) > self._rank(seq)]
        return max(later, key=self._rank) if later else None

    def _seat_for(self, seq: Sequence) -> Sequence | None:
        """Whom the waiting head may evict for a seat when all are taken: under the priority
        policy, the least urgent sequence of a strictly lower priority (a larger number). The
        gateway binds a higher band's request to a full pod on that promise, so that its wait
        is the next step rather than the next request to finish. Equal priorities never
        displace each other: arrival order alone is no reason to recompute."""
        if self.policy != "priority":
            return None
        lower = [
            c
            for c in (*self.running, *self.parked)
            if c.priority > seq.priority and c.request_id != seq.request_id
        ]
        return max(lower, key=self._rank) if lower else None

    def _stamp(self, out: SchedulerOutput) -> None:
        """Note when each request first ran, and hand over the sequences freed since."""
        now = time.monotonic()
        for item in out.scheduled:
            group = self.groups[item.seq.request_id]
            if group.first_scheduled_time is None:
                group.first_scheduled_time = now
        out.finished_seq_ids, self._freed = self._freed, []

    # -- after a step -------------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[RequestUpdate]:
        """Apply one step's results: the only place scheduling state changes after a step.

        Each request is applied on its own: if anything fails for one, that request alone is
        ended with an error (and its blocks freed), and the others go on."""
        by_group: dict[str, list[ScheduledSequence]] = {}
        for item in out.scheduled:
            by_group.setdefault(item.seq.request_id, []).append(item)
        updates: list[RequestUpdate] = []
        failed: dict[str, str] = {}
        for rid, items in by_group.items():
            group = self.groups[rid]
            try:
                update = self._apply(group, items, result)
            except Exception as exc:
                log.exception("applying a step's output failed", extra={"request_id": rid})
                failed[rid] = f"internal error while applying the step: {exc!r}"
                continue
            if update is not None:
                updates.append(update)
        for rid, message in failed.items():
            updates += self.finish_requests([rid], "error", message)
        return updates

    def _apply(
        self, group: SequenceGroup, items: list[ScheduledSequence], result: ModelRunnerOutput
    ) -> RequestUpdate | None:
        update = RequestUpdate(
            group.request_id,
            num_cached_tokens=group.seqs[0].num_cached_tokens,
            first_scheduled_time=group.first_scheduled_time,
        )
        changed = False
        for item in items:
            seq = item.seq
            verified = result.verified.get(seq.seq_id) if item.draft else None
            if verified is not None:
                self._take_verified(item, verified, update)
                update.sampled = changed = True
                continue
            self._computed(seq, item.num_new_tokens)
            prompt_logprobs = result.prompt_logprobs.get(seq.seq_id)
            if prompt_logprobs is not None:
                update.prompt_logprobs = prompt_logprobs
                changed = True
            sample = result.sampled.get(seq.seq_id)
            if sample is None:
                continue
            self.progress += 1
            update.sampled = changed = True
            if group.beam is not None:
                group.pending[seq.seq_id] = sample
                self._park(seq)
            else:
                self._append(seq, sample, update)
        if group.beam is not None:
            self._advance_beams(group, update)
        else:
            self.finish([s for s in group.live if s.finish_reason is not None])
        update.finished = self._drop_if_done(group)
        return update if changed or update.finished else None

    def _computed(self, seq: Sequence, num_tokens: int) -> None:
        """``num_tokens`` more have their KV in the cache: progress where they are new (not
        recomputed after a preemption), and full blocks published for prefix reuse."""
        seq.num_computed_tokens += num_tokens
        if seq.num_computed_tokens > seq.computed_high:
            self.progress += seq.num_computed_tokens - seq.computed_high
            seq.computed_high = seq.num_computed_tokens
        self.kv.commit_computed(seq)

    def _take_verified(
        self, item: ScheduledSequence, tokens: list[TokenLogprobs], update: RequestUpdate
    ) -> None:
        """A verified draft's tokens, one by one as if sampled one step each (a stop ends them
        there). The KV written for each token taken is valid, since each was computed after
        the tokens before it; what follows (the rejected drafts' positions) is overwritten
        by the next step."""
        seq, draft = item.seq, item.draft
        taken = 0
        for sample in tokens:
            self._append(seq, sample, update)
            taken += 1
            if seq.finish_reason is not None:
                break
        self._computed(seq, taken)
        self.progress += taken
        self.drafting.verified(seq, draft, [t.token_id for t in tokens])

    def _append(self, seq: Sequence, sample: TokenLogprobs, update: RequestUpdate) -> None:
        """Take a sampled token: cumulative logprob, token-level stop checks."""
        seq.append_token(sample.token_id)
        if sample.logprob is not None:
            seq.cumulative_logprob += sample.logprob
        self._check_stop(seq, sample.token_id)
        update.seqs.append(
            SequenceUpdate(
                [sample.token_id],
                [sample] if seq.params.logprobs is not None else [],
                seq.finish_reason,
                seq.stop_reason,
                seq.cumulative_logprob if seq.params.needs_logprob else None,
            )
        )

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif (params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens) or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = "length"

    def _advance_beams(self, group: SequenceGroup, update: RequestUpdate) -> None:
        """A beam-search round, once every live beam has sampled: forked beams share their
        parents' blocks and dropped beams free theirs at once."""
        beams = group.step_beams()
        if beams is None:
            return
        for parent, child in beams.forks:
            self.kv.fork(parent, child)
        for seq in beams.running:
            self.add_running(seq)
        self.finish(beams.dropped)
        if beams.done:
            update.hypotheses = group.beam_results("length")
