"""The contract between the model runner and an attention implementation.

The model runner flattens every scheduled sequence's new tokens into one batch of ``T`` tokens,
decodes first, and describes that batch once per step with :class:`AttentionMetadata`. Each layer
then calls :meth:`AttentionBackend.forward`, which writes the new keys and values into the paged
cache and attends over each sequence's whole context.

KV cache layout (both backends): per layer, ``key`` and ``value`` are
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``j`` of a sequence lives in slot
``block_table[j // block_size] * block_size + j % block_size``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch


class LayerKVCache(NamedTuple):
    key: torch.Tensor
    value: torch.Tensor
    # int8 caches only: fp32 scale per (slot, KV head), [num_blocks, block_size, num_kv_heads].
    key_scale: torch.Tensor | None = None
    value_scale: torch.Tensor | None = None


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_row = self.head_dim * elem
        if self.dtype == torch.int8:
            per_row += 4  # the row's fp32 scale
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * per_row


@dataclass
class AttentionMetadata:
    """Layout of one step's flat token batch.

    Sequences ``[0, num_decodes)`` contribute exactly one query token each; the rest are prefill
    chunks of any length. ``seq_lens`` counts each sequence's context *including* this step's
    tokens. Padded token slots (CUDA graphs) have ``slot_mapping == -1``.
    """

    num_decodes: int
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int
    max_seq_len: int
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @classmethod
    def for_prefills(
        cls, lengths: list[int], block_size: int, device: torch.device
    ) -> AttentionMetadata:
        """Fresh prefills of whole sequences, laid out one after another from block 0: for
        running the model outside the engine (calibration, offline evaluation)."""
        tables: list[list[int]] = []
        slots: list[int] = []
        starts, first = [0], 0
        for n in lengths:
            blocks = -(-n // block_size)
            tables.append(list(range(first, first + blocks)))
            slots += range(first * block_size, first * block_size + n)
            first += blocks
            starts.append(starts[-1] + n)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return cls(
            num_decodes=0,
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(lengths),
            max_seq_len=max(lengths),
            query_start_loc_cpu=starts,
            seq_lens_cpu=list(lengths),
        )


class AttentionBackend(ABC):
    name: ClassVar[str]

    def __init__(self, spec: KVCacheSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device

    def allocate(self, num_blocks: int) -> list[LayerKVCache]:
        """Per layer, zeroed keys and values; int8 caches also get their fp32 scales."""
        shape = (num_blocks, self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim)

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=self.device)

        int8 = self.spec.dtype == torch.int8
        return [
            LayerKVCache(
                zeros(shape, self.spec.dtype),
                zeros(shape, self.spec.dtype),
                zeros(shape[:-1], torch.float32) if int8 else None,
                zeros(shape[:-1], torch.float32) if int8 else None,
            )
            for _ in range(self.spec.num_layers)
        ]

    def copy_blocks(self, caches: list[LayerKVCache], copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared blocks (and their scales) before a sequence writes
        into them."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for layer in caches:
            for part in layer:
                if part is not None:
                    part[dst] = part[src]

    def begin_step(self, meta: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Precompute whatever all layers of one step share (workspaces, masks)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store ``k``/``v`` ([T, Hkv, D]) into ``cache`` and return attention output [T, Hq, D]."""
