"""Turn a scheduler decision into tensors, run the model, sample next tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ladle.runtime.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from ladle.runtime.cuda_graphs import DecodeGraphRunner
from ladle.runtime.kernels.decode_step import CpuDecodeStep
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.lora.manager import LoRAManager
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.sampler import Sampler, TokenLogprobs, token_logprobs
from ladle.runtime.scheduler_output import ScheduledSequence, SchedulerOutput
from ladle.runtime.sequence import Sequence


@dataclass
class ModelRunnerOutput:
    """The sampled token of each sequence that reached its end, by ``seq_id``; and for
    sequences that asked for prompt logprobs, (first position, logprobs) of the prompt tokens
    that this step's chunk predicted."""

    sampled: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Sequences that verified a draft: the draft tokens accepted and one more, by ``seq_id``.
    verified: dict[int, list[TokenLogprobs]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        attention: AttentionBackend,
        caches: list[LayerKVCache],
        kv: KVCacheManager,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attention = attention
        self.caches = caches
        self.kv = kv
        self.device = device
        self.block_size = kv.block_size
        self.sampler = Sampler(device)
        # Set by the engine on CUDA: replays decode-only steps from captured graphs.
        self.graphs: DecodeGraphRunner | None = None
        # Set by the engine on CPUs: small decode-only steps in one C call.
        self.fused: CpuDecodeStep | None = None
        # Set by the engine with --enable-lora.
        self.lora: LoRAManager | None = None

    def _prepare(
        self, batch: list[ScheduledSequence]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        token_ids: list[int] = []
        positions: list[int] = []
        seq_index: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        for i, item in enumerate(batch):
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            token_ids.extend(seq.token_ids[start : start + n - len(item.draft)])
            token_ids.extend(item.draft)
            positions.extend(range(start, start + n))
            seq_index.extend([i] * n)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            tables.append(self.kv.block_tables[seq.seq_id])
        width = max(len(t) for t in tables)
        dev = self.device
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        pos = torch.tensor(positions, dtype=torch.long)
        rows = torch.tensor(seq_index, dtype=torch.long)
        slots = block_tables[rows, pos // self.block_size].long() * self.block_size
        slots += pos % self.block_size
        num_decodes = sum(1 for item in batch if item.num_new_tokens == 1)
        meta = AttentionMetadata(
            num_decodes=num_decodes,
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables.to(dev),
            slot_mapping=slots.to(dev),
            max_query_len=max(item.num_new_tokens for item in batch),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=query_start,
            seq_lens_cpu=seq_lens,
        )
        return torch.tensor(token_ids, dtype=torch.long, device=dev), pos.to(dev), meta

    def release(self, seq_ids: list[int]) -> None:
        """Forget per-sequence state (seeded generators) of sequences that ended."""
        for seq_id in seq_ids:
            self.sampler.forget(seq_id)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; sample for each sequence that reached its end."""
        self.release(out.finished_seq_ids)
        self.attention.copy_blocks(self.caches, out.block_copies)
        # Decodes first: the attention backends batch the one-token queries together.
        batch = sorted(out.scheduled, key=lambda item: item.num_new_tokens != 1)
        batch, lora = self._adapters(batch)
        input_ids, positions, meta = self._prepare(batch)
        # A fused CPU step computes every row's logits with the rest (each row of a
        # decode-only step is its sequence's last token).
        all_logits: torch.Tensor | None = None
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta, lora)
        elif self.fused is not None and self.fused.can_run(meta):
            hidden, all_logits = self.fused.run(input_ids, positions, meta, lora)
        else:
            hidden = self.model.forward(input_ids, positions, self.caches, meta, lora)
        result = ModelRunnerOutput(prompt_logprobs=self._prompt_logprobs(batch, hidden, meta))
        sample_rows = [i for i, item in enumerate(batch) if item.completes_prompt]
        if not sample_rows:
            return result
        if all_logits is not None and len(sample_rows) == len(batch):
            logits = all_logits
        else:
            # A sequence verifying a draft needs every row of its chunk; the others their last.
            ends = meta.query_start_loc_cpu
            rows = [
                r
                for i in sample_rows
                for r in range(ends[i + 1] - 1 - len(batch[i].draft), ends[i + 1])
            ]
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        self._sample(batch, sample_rows, logits, result)
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
        triton = self.attention.name == "triton"
        return batch, LoRABatch.build([slot(i) for i in batch], rows, self.device, triton)

    def _prompt_logprobs(
        self, batch: list[ScheduledSequence], hidden: torch.Tensor, meta: AttentionMetadata
    ) -> dict[int, tuple[int, list[TokenLogprobs]]]:
        """Logprobs of the prompt tokens each chunk predicts: position p's logits score prompt
        token p + 1."""
        result: dict[int, tuple[int, list[TokenLogprobs]]] = {}
        for i, item in enumerate(batch):
            seq = item.seq
            if seq.params.prompt_logprobs is None:
                continue
            start = seq.num_computed_tokens
            end = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
            if end <= start:
                continue
            first = meta.query_start_loc_cpu[i]
            logits = self.model.compute_logits(hidden[first : first + end - start])
            targets = torch.tensor(seq.token_ids[start + 1 : end + 1], device=self.device)
            num_top = [seq.params.prompt_logprobs] * (end - start)
            result[seq.seq_id] = (
                start + 1,
                token_logprobs(logits, targets, num_top),
            )
        return result
