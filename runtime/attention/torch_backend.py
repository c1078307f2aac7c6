"""Attention in plain torch, for CPU (and as the reference for the Triton kernels).

Decodes are batched into one SDPA call: each sequence's blocks are gathered into a reused
workspace, and the query heads that share a KV head are packed as rows of one query, so grouped
KV is never repeated. Prefill chunks run one SDPA call each, reading any earlier context (prefix
hits, previous chunks) from the cache.

A cache of another type than the model's (int8 with per-(token, head) scales, as the kernels
write it, or fp16 under an fp32 model) is widened on read, and prefills then always read their
keys and values back from the cache, so a prompt attends to the same rounded values whether or
not its prefix came from the prefix cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ladle.runtime.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    KVCacheSpec,
    LayerKVCache,
)
from ladle.runtime.quantization.formats import quantize_kv_rows


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, spec: KVCacheSpec, device: torch.device) -> None:
        super().__init__(spec, device)
        self._workspace = torch.empty(0, dtype=self.spec.dtype, device=self.device)
        self._decode_blocks = torch.empty(0, dtype=torch.long, device=self.device)
        self._decode_mask = torch.empty(0, dtype=torch.bool, device=self.device)
        self._prefill_masks: dict[int, torch.Tensor] = {}

    def begin_step(self, meta: AttentionMetadata) -> None:
        if meta.num_decodes:
            self._begin_decodes(meta)
        self._begin_prefills(meta)

    def _begin_prefills(self, meta: AttentionMetadata) -> None:
        """A causal mask per prefill chunk that continues earlier context."""
        self._prefill_masks = {}
        for i in range(meta.num_decodes, meta.num_seqs):
            q_len = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
            ctx = meta.seq_lens_cpu[i]
            if ctx != q_len:
                # Causal, aligned to the end: query j sits at absolute position ctx - q_len + j.
                rows = torch.arange(ctx - q_len, ctx, device=self.device)[:, None]
                self._prefill_masks[i] = torch.arange(ctx, device=self.device)[None, :] <= rows

    def _begin_decodes(self, meta: AttentionMetadata) -> None:
        bs = self.spec.block_size
        nd = meta.num_decodes
        max_blocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
        self._decode_blocks = meta.block_tables[:nd, :max_blocks].reshape(-1).long()
        span = torch.arange(max_blocks * bs, device=self.device)
        self._decode_mask = (span[None, :] < meta.seq_lens[:nd, None])[:, None, None, :]
        per_cache = nd * max_blocks * bs * self.spec.num_kv_heads * self.spec.head_dim
        if self.spec.dtype != torch.int8 and self._workspace.numel() < 2 * per_cache:
            self._workspace = torch.empty(2 * per_cache, dtype=self.spec.dtype, device=self.device)

    def _gather(
        self, cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor, part: int
    ) -> torch.Tensor:
        if scale is not None:
            return _read(cache, scale, blocks)
        n = blocks.numel() * self.spec.block_size
        size = n * self.spec.num_kv_heads * self.spec.head_dim
        out = self._workspace[part * size : (part + 1) * size].view(
            blocks.numel(), self.spec.block_size, self.spec.num_kv_heads, self.spec.head_dim
        )
        return torch.index_select(cache, 0, blocks, out=out)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self._store(k, v, cache, meta)
        out = torch.empty_like(q)
        if meta.num_decodes:
            self._decode(q, cache, meta, scale, out)
        self._prefill(q, k, v, cache, meta, scale, out)
        return out

    def _store(
        self, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata
    ) -> None:
        hkv, dim = self.spec.num_kv_heads, self.spec.head_dim
        slots = meta.slot_mapping
        if cache.key_scale is None or cache.value_scale is None:
            cache.key.view(-1, hkv, dim).index_copy_(0, slots, k.to(cache.key.dtype))
            cache.value.view(-1, hkv, dim).index_copy_(0, slots, v.to(cache.value.dtype))
            return
        for rows, part, scales in (
            (k, cache.key, cache.key_scale),
            (v, cache.value, cache.value_scale),
        ):
            q, s = quantize_kv_rows(rows)
            part.view(-1, hkv, dim).index_copy_(0, slots, q)
            scales.view(-1, hkv).index_copy_(0, slots, s)

    def _decode(
        self,
        q: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the first ``num_decodes`` rows, one query token per sequence."""
        hkv, dim = self.spec.num_kv_heads, self.spec.head_dim
        nd = meta.num_decodes
        span = self._decode_mask.shape[-1]
        blocks = self._decode_blocks
        keys = self._gather(cache.key, cache.key_scale, blocks, 0).view(nd, span, hkv, dim)
        values = self._gather(cache.value, cache.value_scale, blocks, 1).view(nd, span, hkv, dim)
        group = q.shape[1] // hkv
        packed = q[:nd].view(nd, hkv, group, dim)
        attn = F.scaled_dot_product_attention(
            packed,
            keys.transpose(1, 2).to(q.dtype),
            values.transpose(1, 2).to(q.dtype),
            attn_mask=self._decode_mask,
            scale=scale,
        )
        out[:nd] = attn.reshape(nd, hkv * group, dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: LayerKVCache,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """One SDPA call per prefill chunk, reading earlier context from the cache."""
        hkv, dim = self.spec.num_kv_heads, self.spec.head_dim
        bs = self.spec.block_size
        for i in range(meta.num_decodes, meta.num_seqs):
            start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            ctx = meta.seq_lens_cpu[i]
            mask = self._prefill_masks.get(i)
            if mask is None and cache.key.dtype == q.dtype:
                keys, values = k[start:end], v[start:end]
            else:
                blocks = meta.block_tables[i, : -(-ctx // bs)].long()
                keys = _read(cache.key, cache.key_scale, blocks).view(-1, hkv, dim)[:ctx]
                values = _read(cache.value, cache.value_scale, blocks).view(-1, hkv, dim)[:ctx]
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            attn = F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1)[None],
                keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[start:end] = attn[0].transpose(0, 1)


def _read(cache: torch.Tensor, scale: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """Whole blocks of one cache; an int8 cache's rows times their scales, in fp32."""
    if scale is None:
        return cache[blocks]
    return cache[blocks].to(torch.float32) * scale[blocks][..., None]
