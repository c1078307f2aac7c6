"""A lighter model drafts: by default the served model's own weights rounded to int4 (or int8),
else another model with the same vocabulary. It proposes k tokens greedily, one cheap decode
each, and the model verifies them in one step, so greedy output stays the model's own.

The draft's KV cache mirrors the model's: the same block ids, in tensors of its own. The
draft computes every token the model computes, in the same step, so a block the prefix cache
hands out or a preempted sequence recomputes holds the draft's keys too, and neither needs
anything of its own here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from transformers import AutoConfig

from ladle.runtime.attention.backend import KVCacheSpec
from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.forward_pass import Chunk, ForwardPass, build_plan
from ladle.runtime.models.build import build_model
from ladle.runtime.models.config import ModelConfig, model_config_from_hf
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.models.loader import resolve_model
from ladle.runtime.quantization.apply import int8_activations
from ladle.runtime.scheduler_output import ScheduledSequence
from ladle.runtime.spec_decode.config import SpeculativeConfig


def build_draft(
    args: EngineArgs,
    spec: SpeculativeConfig,
    cfg: ModelConfig,
    model_path: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[LlamaModel, KVCacheSpec]:
    """The drafter and the shape of its KV cache. Raises ConfigError when its vocabulary is
    not the model's (its token ids would mean other words)."""
    path, draft_cfg = model_path, cfg
    if spec.model is not None:
        path = resolve_model(spec.model)
        draft_cfg = model_config_from_hf(AutoConfig.from_pretrained(path))
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ConfigError(
            f"speculative config: the draft model's vocabulary has {draft_cfg.vocab_size} "
            f"tokens and the model's {cfg.vocab_size}; a drafter must share the model's "
            "tokenizer"
        )
    draft_args = dataclasses.replace(
        args,
        quantization=None if spec.quantization == "none" else spec.quantization,
        quantization_method=None,
        quantization_group_size=None,
        enable_lora=False,
    )
    model, kv_spec = build_model(draft_args, draft_cfg, path, device, dtype)
    # A drafter's numerics sway only how many of its tokens are accepted, never the output:
    # its decode products may round their activations to int8 where the CPU multiplies those
    # natively, about 1.8x faster (``bench/quant_gemm.py``).
    int8_activations(model)
    return model, kv_spec


class DraftModel:
    """Fills the draft slots the scheduler reserved (``ScheduledSequence.draft``) before the
    step runs, and keeps the draft's cache level with the model's."""

    def __init__(self, forward: ForwardPass, block_size: int) -> None:
        self.forward = forward
        self.block_size = block_size
        # Tokens of each sequence whose keys and values the draft's cache holds. After a step
        # that accepted every draft token it lags the model's by one (the last draft token
        # was verified but never fed to the draft); the next step feeds it.
        self._computed: dict[int, int] = {}

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._computed.pop(seq_id, None)

    @torch.inference_mode()
    def propose(
        self,
        batch: list[ScheduledSequence],
        block_tables: dict[int, list[int]],
        block_copies: list[tuple[int, int]],
    ) -> None:
        """One pass over every sequence's tokens of this step (whose last rows give each
        drafting sequence its first draft token), then one decode per further draft token."""
        chunks: list[tuple[ScheduledSequence, Chunk]] = []
        for item in batch:
            seq = item.seq
            start = seq.num_computed_tokens
            end = start + item.num_new_tokens - len(item.draft)
            # A sequence new to the draft starts where the model's cache does (prefix hits
            # included); one recomputed after preemption starts over there too.
            begin = min(self._computed.get(seq.seq_id, start), start)
            table = block_tables[seq.seq_id]
            chunks.append((item, Chunk(seq.token_ids[begin:end], begin, table)))
            self._computed[seq.seq_id] = end
        chunks.sort(key=lambda pair: len(pair[1].token_ids) != 1)
        drafting = [(item, chunk) for item, chunk in chunks if item.draft]
        rows: list[int] = []
        row = 0
        for item, chunk in chunks:
            row += len(chunk.token_ids)
            if item.draft:
                rows.append(row - 1)
        plan = build_plan([c for _, c in chunks], self.block_size, rows, block_copies)
        tokens = self._greedy(self.forward(plan))
        for step in range(1, max((len(item.draft) for item, _ in drafting), default=0) + 1):
            for (item, _), token in zip(drafting, tokens, strict=True):
                item.draft[step - 1] = token
            drafting = [(item, chunk) for item, chunk in drafting if len(item.draft) > step]
            if not drafting:
                break
            # Draft token ``step`` goes in after the sequence's own tokens and those before it.
            fed = [
                Chunk(
                    [item.draft[step - 1]],
                    chunk.start + len(chunk.token_ids) + step - 1,
                    chunk.block_table,
                )
                for item, chunk in drafting
            ]
            plan = build_plan(fed, self.block_size, list(range(len(fed))))
            tokens = self._greedy(self.forward(plan))
        for item in batch:
            if item.draft:
                self._computed[item.seq.seq_id] += len(item.draft) - 1

    @staticmethod
    def _greedy(logits: torch.Tensor) -> list[int]:
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
