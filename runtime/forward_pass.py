"""One step's forward pass, from a plan that every tensor-parallel rank runs alike.

The model runner (rank 0) turns the scheduler's decision into a :class:`StepPlan`; the other
ranks receive the plan and run the same :class:`ForwardPass` on their slice of the model, so
their collectives line up.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ladle.runtime.attention.backend import AttentionMetadata, LayerKVCache
from ladle.runtime.cuda_graphs import DecodeGraphRunner
from ladle.runtime.kernels import decode_step
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

    def as_decodes(self) -> StepPlan:
        """Every token as a one-token row whose sequence ends at its own position: the same
        attention, causal within each chunk, in the shape of a decode-only step. Right where
        every row's keys are stored before any row attends (the fused CPU step)."""
        lengths = torch.tensor(self.query_start[1:]) - torch.tensor(self.query_start[:-1])
        rows = torch.repeat_interleave(torch.arange(len(self.seq_lens)), lengths)
        count = len(self.positions)
        return dataclasses.replace(
            self,
            num_decodes=count,
            query_start=list(range(count + 1)),
            seq_lens=[p + 1 for p in self.positions.tolist()],
            block_tables=self.block_tables[rows].contiguous(),
            max_query_len=1,
        )

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


@dataclass(frozen=True)
class Chunk:
    """One sequence's tokens in a step: computed from position ``start``, into its blocks."""

    token_ids: list[int]
    start: int
    block_table: list[int]


def build_plan(
    chunks: list[Chunk],
    block_size: int,
    logit_rows: list[int],
    block_copies: list[tuple[int, int]] | None = None,
) -> StepPlan:
    """The step's tensors for ``chunks``, one-token chunks (decodes) first: the attention
    backends batch those together."""
    token_ids = [t for c in chunks for t in c.token_ids]
    positions = [p for c in chunks for p in range(c.start, c.start + len(c.token_ids))]
    seq_index = [i for i, c in enumerate(chunks) for _ in c.token_ids]
    query_start = [0]
    for c in chunks:
        query_start.append(query_start[-1] + len(c.token_ids))
    width = max(len(c.block_table) for c in chunks)
    block_tables = torch.tensor(
        [c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=torch.int32
    )
    pos = torch.tensor(positions, dtype=torch.long)
    rows = torch.tensor(seq_index, dtype=torch.long)
    slots = block_tables[rows, pos // block_size].long() * block_size + pos % block_size
    return StepPlan(
        input_ids=torch.tensor(token_ids, dtype=torch.long),
        positions=pos,
        num_decodes=sum(1 for c in chunks if len(c.token_ids) == 1),
        query_start=query_start,
        seq_lens=[c.start + len(c.token_ids) for c in chunks],
        block_tables=block_tables,
        slot_mapping=slots,
        max_query_len=max(len(c.token_ids) for c in chunks),
        block_copies=block_copies or [],
        logit_rows=logit_rows,
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

    def enable_fast_paths(self, max_num_seqs: int, max_model_len: int, block_size: int) -> None:
        """Decode steps as one call: CUDA graphs on a GPU with the Triton backend, the fused C
        step on CPUs."""
        model, device = self.model, self.device
        if device.type == "cuda" and model.attention.name == "triton":
            self.graphs = DecodeGraphRunner(
                model, self.caches, max_num_seqs, max_model_len, block_size, device, use_graphs=True
            )
            self.graphs.capture()
        if model.attention.name == "cpu":
            self.fused = decode_step.for_model(model, self.caches)

    @torch.inference_mode()
    def __call__(self, plan: StepPlan, lora: LoRABatch | None = None) -> torch.Tensor:
        """Write the step's keys and values into the cache; the logits of ``plan.logit_rows``
        (on ranks other than 0, of this rank's vocabulary slice)."""
        self.model.attention.copy_blocks(self.caches, plan.block_copies)
        fused = self.fused
        if fused is not None and plan.max_query_len > 1 and len(plan.positions) <= fused.max_batch:
            # A few tokens of prompt or a draft to verify: one fused call instead of the
            # per-op path.
            plan = plan.as_decodes()
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
