"""Turn a scheduler decision into a step plan, run it, sample next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ladle.runtime.forward_pass import Chunk, ForwardPass, StepPlan, build_plan
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.lora.manager import LoRAManager
from ladle.runtime.parallel.peers import Peers
from ladle.runtime.sampler import Sampler, TokenLogprobs, token_logprobs
from ladle.runtime.scheduler_output import ScheduledSequence, SchedulerOutput
from ladle.runtime.sequence import Sequence
from ladle.runtime.spec_decode.draft_model import DraftModel


@dataclass
class ModelRunnerOutput:
    """The sampled token of each sequence that reached its end, by ``seq_id``; and for
    sequences that asked for prompt logprobs, (first position, logprobs) of the prompt tokens
    that this step's chunk predicted."""

    sampled: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Sequences that verified a draft: the draft tokens accepted and one more, by ``seq_id``.
    verified: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


@dataclass(frozen=True)
class _PromptSpan:
    """A sequence whose chunk scores prompt tokens: positions ``start`` onwards, ``count`` of
    them, whose logits begin at ``first_row`` of the step's logits."""

    seq: Sequence
    start: int
    first_row: int
    count: int


class ModelRunner:
    def __init__(self, forward: ForwardPass, kv: KVCacheManager) -> None:
        self.forward = forward
        self.kv = kv
        self.device = forward.device
        self.block_size = kv.block_size
        self.sampler = Sampler(self.device)
        # Set by the engine with --enable-lora.
        self.lora: LoRAManager | None = None
        # Set by the engine with tensor parallelism: the other ranks, which run each plan too.
        self.peers: Peers | None = None
        # Set by the engine with speculative method draft_model: fills the reserved drafts.
        self.drafter: DraftModel | None = None

    def _plan(
        self, batch: list[ScheduledSequence], block_copies: list[tuple[int, int]]
    ) -> tuple[StepPlan, list[_PromptSpan]]:
        """The step's tensors, and which logits it needs: first the rows each sampling
        sequence samples from (its last, or its draft's and the one after), then the rows
        whose logits score prompt tokens."""
        chunks: list[Chunk] = []
        query_start = [0]
        for item in batch:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            own = seq.token_ids[start : start + n - len(item.draft)]
            chunks.append(Chunk(own + item.draft, start, self.kv.block_tables[seq.seq_id]))
            query_start.append(query_start[-1] + n)
        logit_rows = [
            r
            for i, item in enumerate(batch)
            if item.completes_prompt
            for r in range(query_start[i + 1] - 1 - len(item.draft), query_start[i + 1])
        ]
        spans: list[_PromptSpan] = []
        for i, item in enumerate(batch):
            seq = item.seq
            start = seq.num_computed_tokens
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if seq.params.prompt_logprobs is None or end <= start:
                continue
            spans.append(_PromptSpan(seq, start, len(logit_rows), end - start))
            logit_rows.extend(range(query_start[i], query_start[i] + end - start))
        return build_plan(chunks, self.block_size, logit_rows, block_copies), spans

    def release(self, seq_ids: list[int]) -> None:
        """Forget per-sequence state (seeded generators) of sequences that ended."""
        for seq_id in seq_ids:
            self.sampler.forget(seq_id)
        if self.drafter is not None:
            self.drafter.forget(seq_ids)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; sample for each sequence that reached its end."""
        self.release(out.finished_seq_ids)
        # Decodes first: the attention backends batch the one-token queries together.
        batch = sorted(out.scheduled, key=lambda item: item.num_new_tokens != 1)
        batch, lora = self._adapters(batch)
        if self.drafter is not None:
            self.drafter.propose(batch, self.kv.block_tables, out.block_copies)
        plan, spans = self._plan(batch, out.block_copies)
        if self.peers is not None:
            self.peers.send(plan)
        logits = self.forward(plan, lora)
        result = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(spans, logits))
        sample_rows = [i for i, item in enumerate(batch) if item.completes_prompt]
        if sample_rows:
            sampled = sum(len(batch[i].draft) + 1 for i in sample_rows)
            self._sample(batch, sample_rows, logits[:sampled], result)
        return result

    def _sample(
        self,
        batch: list[ScheduledSequence],
        sample_rows: list[int],
        logits: torch.Tensor,
        result: ModelRunnerOutput,
    ) -> None:
        """Each sequence's next token, and each draft's verification (``logits`` holds a row
        per sequence without a draft and ``len(draft) + 1`` rows per one with, in order)."""
        plain_rows: list[int] = []
        draft_rows: list[int] = []
        plain_seqs: list[Sequence] = []
        draft_items: list[ScheduledSequence] = []
        row = 0
        for i in sample_rows:
            item = batch[i]
            width = len(item.draft) + 1
            if item.draft:
                draft_rows.extend(range(row, row + width))
                draft_items.append(item)
            else:
                plain_rows.append(row)
                plain_seqs.append(item.seq)
            row += width
        if plain_seqs:
            rows = logits if not draft_items else logits[plain_rows]
            samples = self.sampler(rows, plain_seqs)
            result.sampled = {seq.seq_id: s for seq, s in zip(plain_seqs, samples, strict=True)}
        if draft_items:
            verified = self.sampler.verify(
                logits[draft_rows], [i.seq for i in draft_items], [i.draft for i in draft_items]
            )
            result.verified = {
                item.seq.seq_id: tokens for item, tokens in zip(draft_items, verified, strict=True)
            }

    def _adapters(
        self, batch: list[ScheduledSequence]
    ) -> tuple[list[ScheduledSequence], LoRABatch | None]:
        """Load the step's adapters into slots, and order rows of one adapter together
        (decodes still first) so that each adapter is one run of rows per kind."""
        adapters = [item.seq.lora for item in batch if item.seq.lora]
        if self.lora is None or not adapters:
            return batch, None
        slots = self.lora.activate(adapters)

        def slot(item: ScheduledSequence) -> int:
            lora = item.seq.lora
            return -1 if lora is None else slots[lora.lora_int_id]

        batch = sorted(batch, key=lambda item: (item.num_new_tokens != 1, slot(item)))
        rows = [item.num_new_tokens for item in batch]
        triton = self.forward.model.attention.name == "triton"
        return batch, LoRABatch.build([slot(i) for i in batch], rows, self.device, triton)

    @staticmethod
    def _prompt_logprobs(
        spans: list[_PromptSpan], logits: torch.Tensor
    ) -> dict[int, tuple[int, list[TokenLogprobs]]]:
        """Logprobs of the prompt tokens each chunk predicts: position p's logits score prompt
        token p + 1."""
        result: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        for span in spans:
            seq, start, count = span.seq, span.start, span.count
            targets = torch.tensor(
                seq.token_ids[start + 1 : start + 1 + count], device=logits.device
            )
            num_top = [seq.params.prompt_logprobs or 0] * count
            rows = logits[span.first_row : span.first_row + count]
            result[seq.seq_id] = (start + 1, token_logprobs(rows, targets, num_top))
        return result
