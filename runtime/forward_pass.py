"""One step's forward pass, from a plan that every tensor-parallel rank runs alike.

The model runner (rank 0) turns the scheduler's decision into a :class:`StepPlan`; the other
ranks receive the plan and run the same :class:`ForwardPass` on their slice of the model, so
their collectives line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ladle.runtime.attention.backend import AttentionMetadata, LayerKVCache
from ladle.runtime.cuda_graphs import DecodeGraphRunner
from ladle.runtime.kernels.decode_step import CpuDecodeStep
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.models.llama import LlamaModel


@dataclass
class StepPlan:
    """Host tensors and lists, cheap to send to the other ranks."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    num_decodes: int
    query_start: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_query_len: int
    block_copies: list[tuple[int, int]]
    # Rows of the step's hidden states that need logits, in the order the sampler reads them.
    logit_rows: list[int]

    def metadata(self, device: torch.device) -> AttentionMetadata:
        return AttentionMetadata(
            num_decodes=self.num_decodes,
            query_start_loc=torch.tensor(self.query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32, device=device),
            block_tables=self.block_tables.to(device),
            slot_mapping=self.slot_mapping.to(device),
            max_query_len=self.max_query_len,
            max_seq_len=max(self.seq_lens),
            query_start_loc_cpu=self.query_start,
            seq_lens_cpu=self.seq_lens,
        )


class ForwardPass:
    def __init__(self, model: LlamaModel, caches: list[LayerKVCache], device: torch.device) -> None:
        self.model = model
        self.caches = caches
        self.device = device
        # Set by the engine on CUDA: replays decode-only steps from captured graphs.
        self.graphs: DecodeGraphRunner | None = None
        # Set by the engine on CPUs: small decode-only steps in one C call.
        self.fused: CpuDecodeStep | None = None

    @torch.inference_mode()
    def __call__(self, plan: StepPlan, lora: LoRABatch | None = None) -> torch.Tensor:
        """Write the step's keys and values into the cache; the logits of ``plan.logit_rows``
        (on ranks other than 0, of this rank's vocabulary slice)."""
        self.model.attention.copy_blocks(self.caches, plan.block_copies)
        dev = self.device
        input_ids, positions = plan.input_ids.to(dev), plan.positions.to(dev)
        meta = plan.metadata(dev)
        if self.graphs is not None and self.graphs.can_run(meta):
            hidden = self.graphs.run(input_ids, positions, meta, lora)
        elif self.fused is not None and self.fused.can_run(meta):
            # A fused step computes every row's logits (each row is its sequence's last token).
            logits = self.fused.run(input_ids, positions, meta, lora)[1]
            if plan.logit_rows == list(range(logits.shape[0])):
                return logits
            return logits[torch.tensor(plan.logit_rows, dtype=torch.long, device=dev)]
        else:
            hidden = self.model.forward(input_ids, positions, self.caches, meta, lora)
        if not plan.logit_rows:
            return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float)
        rows = torch.tensor(plan.logit_rows, dtype=torch.long, device=dev)
        return self.model.compute_logits(hidden[rows])
