"""Incremental detokenization: text deltas that never split a UTF-8 character, with stop strings.

Each step re-decodes a short window of tokens before the unread ones (vLLM's prefix and read
offsets), so tokenizers whose decoding depends on the neighbouring token (leading-space markers,
byte fallback) still produce exactly the text of a full decode. Text that ends in a partial
character is held back until the character completes or the stream ends.

Stop strings are matched on the decoded text, so one split across tokens is still found. While
the sequence runs, the longest end of the text that could still grow into a stop string is held
back from what may be shown; once a stop string matches, the text is cut before it (or after it,
with ``include_stop_str_in_output``).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Any

_WINDOW = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: SequenceOf[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: SequenceOf[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Only matters where the decoder puts separators between tokens (e.g. WordPiece).
        self._split_added = not skip_special_tokens and not spaces_between_special_tokens
        self._added: dict[int, str] = (
            {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
            if self._split_added
            else {}
        )
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids[-_WINDOW - 1 :])
        self._ids: list[int] = context
        self._prefix_offset = max(len(context) - _WINDOW, 0)
        self._read_offset = len(context)
        self.text = ""
        self.num_ids = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        if not self._split_added:
            text: str = self.tokenizer.decode(
                ids,
                skip_special_tokens=self.skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
            return text
        # Added tokens verbatim, ordinary runs decoded on their own: no separators between.
        parts: list[str] = []
        run: list[int] = []
        for token in ids:
            if token in self._added:
                if run:
                    parts.append(self.tokenizer.decode(run, clean_up_tokenization_spaces=False))
                    run = []
                parts.append(self._added[token])
            else:
                run.append(token)
        if run:
            parts.append(self.tokenizer.decode(run, clean_up_tokenization_spaces=False))
        return "".join(parts)

    def _advance(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(full) <= len(prefix) or full.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix) :]

    def update(
        self, token_ids: SequenceOf[int], final: bool = False, check_stop: bool = True
    ) -> str | None:
        """Decode new tokens; ``final`` also releases a trailing partial character.

        Returns the stop string that matched, if any; the text is then cut and later updates
        change nothing.
        """
        if self.stopped:
            return None
        self.num_ids += len(token_ids)
        self._ids.extend(token_ids)
        delta = self._advance(final)
        if not delta:
            return None
        searched = len(self.text)
        self.text += delta
        if not (check_stop and self.stop):
            return None
        return self._match_stop(searched)

    def _match_stop(self, searched: int) -> str | None:
        """Find the earliest stop string in the text not yet searched (plus the overlap a stop
        string could span), and cut the text there."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, max(searched - len(stop) + 1, 0))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop) if self.include_stop_str_in_output else at]
        self.stopped = True
        return stop

    def output_text(self, finished: bool) -> str:
        """The text that may be shown now: while running, hold back an end that could still
        become a stop string."""
        if finished or self.stopped or self.include_stop_str_in_output or not self.stop:
            return self.text
        return self.text[: len(self.text) - self._held_back()]

    def _held_back(self) -> int:
        text = self.text
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held
