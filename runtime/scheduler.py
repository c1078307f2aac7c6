"""Continuous batching: which sequences run this step, and how many tokens each.

One token budget covers prefill chunks and decodes alike, so long prompts are chunked and
share steps with running decodes. When blocks run out, the lowest-priority running sequence
(the newest, under FCFS) is preempted and later recomputed.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """True when this chunk reaches the last known token, so a new token gets sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def _rank(self, seq: Sequence) -> tuple[int, float, int]:
        """Lower ranks are served first; the highest-ranked running sequence is preempted."""
        if self.policy == "priority":
            return (seq.priority, seq.arrival_time, seq.seq_id)
        return (0, seq.arrival_time, seq.seq_id)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        bisect.insort(self.waiting, seq, key=self._rank)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a forked sequence that already has blocks (n>1, beam search)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def detach(self, seq: Sequence) -> None:
        """Stop scheduling a running sequence but keep its blocks: a beam that has sampled
        waits for its siblings, then comes back through ``add_running``."""
        self.running.remove(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

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

    def _preempt(self, victim: Sequence) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.reset_for_recompute()
        self.add(victim)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: dict[int, ScheduledSequence] = {}

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.kv.allocate_slots(seq, num_new):
                victim = max(self.running, key=self._rank)
                self._preempt(victim)
                out.preempted.append(victim)
                undone = scheduled_ids.pop(victim.seq_id, None)
                if undone is not None:
                    out.scheduled.remove(undone)
                    budget += undone.num_new_tokens
                    i -= 1
                if victim is seq:
                    break
            else:
                item = ScheduledSequence(seq, num_new)
                out.scheduled.append(item)
                scheduled_ids[seq.seq_id] = item
                budget -= num_new
                i += 1

        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_num_seqs
            and not out.preempted
        ):
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            num_new = min(seq.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.allocate_slots(seq, num_new, cached):
                refund = self._preempt_for(seq, out, scheduled_ids)
                if refund is None:
                    break
                budget += refund
                continue
            self.waiting.pop(0)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            item = ScheduledSequence(seq, num_new)
            out.scheduled.append(item)
            scheduled_ids[seq.seq_id] = item
            budget -= num_new

        out.block_copies = self.kv.take_pending_copies()
        return out

    def _preempt_for(
        self, seq: Sequence, out: SchedulerOutput, scheduled: dict[int, ScheduledSequence]
    ) -> int | None:
        """Under the priority policy a more urgent waiting sequence evicts the least urgent
        running one, even if it was already scheduled in this step. Returns the tokens refunded
        to the step's budget, or None when nothing may be evicted."""
        if self.policy != "priority" or not self.running:
            return None
        victim = max(self.running, key=self._rank)
        if self._rank(victim) <= self._rank(seq):
            return None
        self._preempt(victim)
        undone = scheduled.pop(victim.seq_id, None)
        if undone is None:
            return 0
        out.scheduled.remove(undone)
        return undone.num_new_tokens

    def on_step_done(self, out: SchedulerOutput) -> None:
        """Advance computed-token counts and publish newly full blocks to the prefix cache."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit_computed(item.seq)
