"""Which decodes draft, how many tokens, and what failed drafts cost: the scheduler's
speculative decisions, the same for both drafters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ladle.runtime.scheduler_output import DRAFT_PENDING
from ladle.runtime.spec_decode.config import SpeculativeConfig
from ladle.runtime.spec_decode.counts import SpecDecodeCounts
from ladle.runtime.spec_decode.ngram import propose

if TYPE_CHECKING:
    from ladle.runtime.kv_cache.manager import KVCacheManager
    from ladle.runtime.sequence import Sequence, SequenceGroup

# The most plain decode steps a sequence whose drafts keep failing goes without one.
MAX_DRAFT_PAUSE = 32


class Drafting:
    def __init__(self, config: SpeculativeConfig | None) -> None:
        self.config = config
        self.counts = SpecDecodeCounts()

    def draft(
        self,
        seq: Sequence,
        group: SequenceGroup,
        num_new: int,
        budget: int,
        max_model_len: int | None,
    ) -> list[int]:
        """Draft tokens for a decoding sequence (not a beam's), at most as many as
        the step's budget, the model's length and the request's ``max_tokens`` leave room for
        (each accepted one is emitted). The draft model's tokens are placeholders, filled in by
        the model runner before the step."""
        spec = self.config
        if spec is None or num_new != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
            return []
        if group.beam is not None:
            return []
        if seq.draft_pause > 0:
            seq.draft_pause -= 1
            return []
        room = min(spec.num_speculative_tokens, budget - 1)
        if max_model_len is not None:
            room = min(room, max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        if room <= 0:
            return []
        if spec.method == "draft_model":
            return [DRAFT_PENDING] * room
        return propose(seq.token_ids, spec.prompt_lookup_min, spec.prompt_lookup_max, room)

    @staticmethod
    def fits(kv: KVCacheManager, seq: Sequence, num_new: int, drafted: int, later: int) -> bool:
        """Whether a draft's KV blocks leave a free block for each running sequence still to
        schedule this step: a draft must not be why another sequence is preempted."""
        held = len(kv.block_tables.get(seq.seq_id, ()))
        plain = max(kv.blocks_needed(seq.num_computed_tokens + num_new), held)
        extra = kv.blocks_needed(seq.num_computed_tokens + num_new + drafted) - plain
        return extra <= 0 or kv.num_free_blocks - extra >= later

    def verified(self, seq: Sequence, draft: list[int], tokens: list[int]) -> None:
        """Count a verified draft. A verification step costs more than a decode: where
        drafts keep failing (text that does not repeat), draft again only after 1, 2, 4 ...
        32 plain decodes."""
        accepted = 0
        while accepted < len(draft) and tokens[accepted] == draft[accepted]:
            accepted += 1
        self.counts.count(len(draft), accepted)
        seq.draft_misses = 0 if accepted else seq.draft_misses + 1
        seq.draft_pause = 0 if accepted else min(2 ** (seq.draft_misses - 1), MAX_DRAFT_PAUSE)
