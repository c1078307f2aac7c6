"""Which slice of each weight a rank holds: pure arithmetic on the model's shape.

Attention is split by whole KV-head groups, so each rank's query heads read only the KV heads
it holds. A model with fewer KV heads than ranks replicates each KV head over
``size // num_kv_heads`` ranks, which split its query heads between them (vLLM's rule). Unlike
vLLM, a head count that the size does not divide is split unevenly rather than refused (the
default model has 9 query heads and 3 KV heads): the ranks then do unequal shares of the
attention work, and the output is the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ladle.runtime.config import ConfigError
from ladle.runtime.models.config import ModelConfig


@dataclass(frozen=True)
class ShardLayout:
    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    # Rows [vocab_start, vocab_start + vocab_rows) of the (zero-padded) embedding and LM head.
    vocab_start: int
    vocab_rows: int

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The shape this rank's forward pass sees; the vocabulary stays whole (the logits
        are gathered before sampling)."""
        return dataclasses.replace(
            cfg,
            num_heads=len(self.q_heads),
            num_kv_heads=len(self.kv_heads),
            intermediate_size=len(self.intermediate),
        )

    def shard(self, suffix: str, tensor: torch.Tensor, head_dim: int) -> torch.Tensor:
        """This rank's part of the HF weight ``suffix`` (the name after ``model.layers.N.``,
        or a top-level name): column-parallel layers lose output rows, row-parallel layers
        input columns, the vocabulary tables rows; norms stay whole."""
        heads = {"q_proj": self.q_heads, "k_proj": self.kv_heads, "v_proj": self.kv_heads}
        module = suffix.split(".")[-2] if "." in suffix else suffix
        if module in heads:
            part = heads[module]
            return tensor[part.start * head_dim : part.stop * head_dim]
        if module in ("gate_proj", "up_proj"):
            return tensor[self.intermediate.start : self.intermediate.stop]
        if module == "o_proj":
            return tensor[:, self.q_heads.start * head_dim : self.q_heads.stop * head_dim]
        if module == "down_proj":
            return tensor[:, self.intermediate.start : self.intermediate.stop]
        if suffix in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = tensor[self.vocab_start : self.vocab_start + self.vocab_rows]
            pad = self.vocab_rows - rows.shape[0]
            return torch.nn.functional.pad(rows, (0, 0, 0, pad)) if pad else rows
        return tensor


def _split(total: int, size: int, rank: int) -> range:
    return range(rank * total // size, (rank + 1) * total // size)


def check_tensor_parallel(cfg: ModelConfig, size: int) -> None:
    """Refuse a size the model cannot be split into, saying which sizes it can."""
    if size == 1:
        return
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    group = heads // kv
    if size > kv and (size % kv or group % (size // kv)):
        fits = [
            n for n in range(2, heads + 1) if n <= kv or (n % kv == 0 and group % (n // kv) == 0)
        ]
        raise ConfigError(
            f"tensor_parallel_size {size} does not split the model's {heads} attention heads "
            f"over its {kv} KV heads; sizes that do: {', '.join(map(str, fits)) or 'none'}"
        )
    if size > cfg.intermediate_size:
        raise ConfigError(
            f"tensor_parallel_size {size} exceeds the model's MLP width {cfg.intermediate_size}"
        )


def shard_layout(cfg: ModelConfig, size: int, rank: int) -> ShardLayout:
    check_tensor_parallel(cfg, size)
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    group = heads // kv
    if size <= kv:
        kv_heads = _split(kv, size, rank)
        q_heads = range(kv_heads.start * group, kv_heads.stop * group)
    else:
        replicas = size // kv
        head = rank // replicas
        per_rank = group // replicas
        first = head * group + (rank % replicas) * per_rank
        kv_heads, q_heads = range(head, head + 1), range(first, first + per_rank)
    rows = -(-cfg.vocab_size // size)
    return ShardLayout(
        rank=rank,
        size=size,
        q_heads=q_heads,
        kv_heads=kv_heads,
        intermediate=_split(cfg.intermediate_size, size, rank),
        vocab_start=rank * rows,
        vocab_rows=rows,
    )
