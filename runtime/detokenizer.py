"""Incremental detokenization: text deltas that never split a UTF-8 character.

Each step re-decodes a short window of tokens before the unread ones, so tokenizers whose
decoding depends on the neighbouring token (leading-space markers, byte fallback) still produce
exactly the text of a full decode, and a delta is held back while it ends in a partial character.
"""

from __future__ import annotations

from typing import Any

_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = set(tokenizer.all_special_ids) if skip_special_tokens else set()
        context = self._tokens(prompt_token_ids[-_WINDOW - 1 :])
        self._tokens_so_far: list[str] = context
        self._prefix_offset = max(len(context) - _WINDOW, 0)
        self._read_offset = len(context)
        self.text = ""
        self.num_ids = 0

    def _tokens(self, ids: list[int]) -> list[str]:
        kept = [i for i in ids if i not in self._special]
        return list(self.tokenizer.convert_ids_to_tokens(kept))

    def step(self, token_ids: list[int]) -> str:
        """Add new token ids; return the text they complete (possibly empty)."""
        self.num_ids += len(token_ids)
        self._tokens_so_far.extend(self._tokens(token_ids))
        to_text = self.tokenizer.convert_tokens_to_string
        prefix: str = to_text(self._tokens_so_far[self._prefix_offset : self._read_offset])
        full: str = to_text(self._tokens_so_far[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens_so_far)
        self.text += delta
        return delta
