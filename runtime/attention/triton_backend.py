"""Attention through the Triton paged kernels: the CUDA path (and CPU under the interpreter).

One step stores every new key and value with one launch, then runs the split-K decode kernel
over the decodes and one varlen prefill launch over the rest. Nothing here reads host copies
of sequence lengths, so a decode-only step can be captured in a CUDA graph; ``max_seq_len``
need only bound the lengths (a graph captures with the model's maximum).

A KV spec with dtype ``torch.int8`` gets an int8 cache with per-(token, head) scales; queries
and outputs stay in the model's dtype.
"""

from __future__ import annotations

import torch

from ladle.runtime.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheSpec,
    LayerKVCache,
)
from ladle.runtime.kernels.attention import decode_workspace, paged_decode_attention
from ladle.runtime.kernels.attention_prefill import paged_prefill_attention
from ladle.runtime.kernels.kv_store import store_kv

# Splits stop paying once each has fewer keys than this to read.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, spec: KVCacheSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        # Aim for two decode programs per SM; on CPU (interpreter) one program is cheapest.
        self.target_programs = (
            2 * torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 1
        )
        self.min_split_tokens = MIN_SPLIT_TOKENS
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def num_splits(self, num_decodes: int, max_seq_len: int) -> int:
        """Enough (sequence, KV head, split) programs to fill the device, none too short."""
        by_occupancy = -(-self.target_programs // (num_decodes * self.spec.num_kv_heads))
        by_length = -(-max_seq_len // self.min_split_tokens)
        return max(1, min(by_occupancy, by_length, MAX_SPLITS))

    def _decode_workspace(
        self, rows: int, num_heads: int, splits: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Grow only: CUDA graphs captured after the largest warm-up keep pointing at it.
        ws = self._workspace
        if ws is None or ws[0].shape[0] < rows or ws[0].shape[1] != num_heads:
            ws = decode_workspace(rows, num_heads, self.spec.head_dim, MAX_SPLITS, self.device)
            self._workspace = ws
        return ws

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        store_kv(
            k,
            v,
            cache.key,
            cache.value,
            meta.slot_mapping,
            cache.key_scale,
            cache.value_scale,
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:
            splits = self.num_splits(nd, meta.max_seq_len)
            paged_decode_attention(
                q[:nd],
                cache.key,
                cache.value,
                meta.block_tables[:nd],
                meta.seq_lens[:nd],
                scale,
                out[:nd],
                num_splits=splits,
                workspace=self._decode_workspace(nd, q.shape[1], splits) if splits > 1 else None,
                key_scale=cache.key_scale,
                value_scale=cache.value_scale,
            )
        if nd < meta.num_seqs:
            paged_prefill_attention(
                q,
                cache.key,
                cache.value,
                meta.block_tables,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                out,
                first_seq=nd,
                num_seqs=meta.num_seqs - nd,
                max_query_len=meta.max_query_len,
                key_scale=cache.key_scale,
                value_scale=cache.value_scale,
            )
        return out
