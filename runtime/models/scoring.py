"""Run the model over whole sequences outside the engine: for calibrating quantization and
for scoring text (``ladle eval``), where every position's hidden state is wanted.

The sequences are prefilled in one forward through the model's own attention backend, into a
scratch KV cache of just their size, so the numerics are the serving path's (an int8 KV cache
included) and the engine's cache is never touched.
"""

from __future__ import annotations

import torch

from ladle.runtime.attention.backend import AttentionMetadata
from ladle.runtime.models.llama import LlamaModel


@torch.inference_mode()
def hidden_states(model: LlamaModel, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Final-norm hidden states of every position, one [len, hidden] tensor per sequence."""
    block_size = model.attention.spec.block_size
    lengths = [len(s) for s in sequences]
    num_blocks = sum(-(-n // block_size) for n in lengths)
    meta = AttentionMetadata.for_prefills(lengths, block_size, model.device)
    caches = model.attention.allocate(num_blocks)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long, device=model.device)
    positions = torch.cat([torch.arange(n, device=model.device) for n in lengths])
    hidden = model.forward(ids, positions, caches, meta)
    return list(hidden.split(lengths))
