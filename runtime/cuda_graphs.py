"""Decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

A decode step launches a dozen small kernels per layer; at small batch their launch overhead,
not the GPU, sets the pace. A graph replays the whole step with one launch. A batch is padded
up to the nearest captured size: padded rows get slot -1 (the KV store skips them) and
sequence length 0 (the decode kernel writes zeros for them), and their outputs are dropped.
Block-table entries past a row's length are never read, so stale ones need no clearing.
With LoRA on, each row's adapter slot is one more static input (padded rows, and rows of the
base model, get -1), so that steps mixing adapters replay the same graphs.
"""

from __future__ import annotations

import logging
import time

import torch

from ladle.runtime.attention.backend import AttentionMetadata, LayerKVCache
from ladle.runtime.lora.batch import LoRABatch
from ladle.runtime.models.llama import LlamaModel

log = logging.getLogger(__name__)


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_batch}
    sizes.update(range(16, max_batch, 16))
    sizes.add(max_batch)
    return sorted(sizes)


class DecodeGraphRunner:
    """Static input buffers plus one captured forward per ladder size.

    With ``use_graphs=False`` the same padded, static-shape forward runs eagerly, which is how
    the padding is tested on machines without CUDA.
    """

    def __init__(
        self,
        model: LlamaModel,
        caches: list[LayerKVCache],
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        use_graphs: bool,
    ) -> None:
        self.model = model
        self.caches = caches
        self.sizes = batch_size_ladder(max_batch)
        self.max_model_len = max_model_len
        self.use_graphs = use_graphs
        rows = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((rows, max_blocks), dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)
        lora = bool(model.layers) and model.layers[0].lora is not None
        self.lora_slots = (
            torch.full((rows,), -1, dtype=torch.int32, device=device) if lora else None
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        # The host copies only bound the device values (the Triton backend reads the latter).
        return AttentionMetadata(
            num_decodes=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[self.max_model_len] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        lora = None
        if self.lora_slots is not None:
            lora = LoRABatch([], self.lora_slots[:size], triton=True)
        return self.model.forward(
            self.input_ids[:size], self.positions[:size], self.caches, self._meta(size), lora
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture largest first, so smaller graphs reuse the memory pool and workspaces."""
        if not self.use_graphs:
            return
        started = time.monotonic()
        pool = None
        for size in reversed(self.sizes):
            # Warm up outside the graph: compiles the kernels, allocates workspaces.
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info(
            "captured decode CUDA graphs",
            extra={"sizes": len(self.sizes), "seconds": round(time.monotonic() - started, 2)},
        )

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (
            meta.num_decodes == meta.num_seqs <= self.sizes[-1]
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Hidden states of a decode-only batch (see :meth:`can_run`), one row per sequence."""
        batch = meta.num_seqs
        size = next(s for s in self.sizes if s >= batch)
        if self.lora_slots is not None:
            self.lora_slots.fill_(-1)
            if lora is not None:
                self.lora_slots[:batch].copy_(lora.row_slots)
        self.input_ids[:batch].copy_(input_ids)
        self.positions[:batch].copy_(positions)
        self.slot_mapping[:batch].copy_(meta.slot_mapping)
        self.slot_mapping[batch:size].fill_(-1)
        self.seq_lens[:batch].copy_(meta.seq_lens)
        self.seq_lens[batch:size].fill_(0)
        self.block_tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if not self.use_graphs:
            return self._forward(size)[:batch]
        self.graphs[size].replay()
        return self.outputs[size][:batch]
