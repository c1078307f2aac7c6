"""One rendering path for the four generation responses: completions and chat, streamed or not.

The engine hands out deltas. :class:`ChoiceState` collects each choice's text, token ids and
logprobs and gives out what may be shown: a stream shows it whenever there is text or an end;
tokens whose text is still held back (a partial UTF-8 character, a possible stop string) wait,
with their logprobs, for the next chunk. A body shows everything once, at the end. Both go
through the same renderers, so a stream is exactly its body cut into chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ladle.runtime.filters.stream import FilteredText, Piece
from ladle.runtime.outputs import CompletionOutput, Logprob, PromptLogprobs
from ladle.runtime.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    TopLogprob,
)

# JSON cannot carry -inf; OpenAI and vLLM clamp to this.
MIN_LOGPROB = -9999.0

# One entry per token: the chosen token and the top-N, or None for a token that has no logprob
# (the first prompt token, which nothing precedes).
TokenLogprobList = list[dict[int, Logprob] | None]


@dataclass
class Echo:
    """The prompt a completion echoes: its text and its token ids (for logprobs)."""

    text: str
    token_ids: list[int]


@dataclass
class Shown:
    """What one chunk (or the whole body) shows of one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: TokenLogprobList | None
    finish_reason: str | None
    stop_reason: int | str | None
    # vLLM's prompt_logprobs extension: with a choice's first chunk.
    prompt_logprobs: PromptLogprobs | None = None
    # Per token, the text an output filter shows in place of the token's own (None: its own).
    token_texts: list[str | None] | None = None


@dataclass
class ChoiceState:
    """One choice across the engine's deltas: what waits to be shown, and what was."""

    index: int
    want_logprobs: bool = False
    echo: Echo | None = None
    # echo with max_tokens 0: the one token generated to run the prompt is not shown.
    drop_generated: bool = False
    # Output filters between the engine's deltas and what is shown.
    filtered: FilteredText | None = None
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: TokenLogprobList = field(default_factory=list)
    token_texts: list[str | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Generated tokens, shown or not (usage counts them).
    num_tokens: int = 0
    # Characters shown so far, for the completions API's text_offset.
    text_offset: int = 0
    started: bool = False

    def add(self, completion: CompletionOutput) -> None:
        self.num_tokens += len(completion.token_ids)
        if self.stopped_by_filter:
            return  # the engine's last words (an abort) change nothing now
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason
            self.stop_reason = completion.stop_reason
        if self.drop_generated:
            return
        piece = Piece(completion.text, list(completion.token_ids), list(completion.logprobs or []))
        if self.filtered is None:
            shown = [piece]
        else:
            shown = self.filtered.push(piece, final=completion.finish_reason is not None)
            if self.filtered.stopped_by is not None:
                self.finish_reason, self.stop_reason = "content_filter", self.filtered.stopped_by
        for part in shown:
            self.text.append(part.text)
            self.token_ids += part.token_ids
            self.logprobs += part.logprobs
            self.token_texts += part.token_texts or [None] * len(part.token_ids)

    @property
    def stopped_by_filter(self) -> bool:
        return self.filtered is not None and self.filtered.stopped

    @property
    def ready(self) -> bool:
        """Whether a stream has something to show: text, the end, or the echo."""
        return (
            any(self.text)
            or self.finish_reason is not None
            or (self.echo is not None and not self.started)
        )

    def take(self, prompt_logprobs: PromptLogprobs | None) -> Shown:
        """Everything collected since the last take; the first take carries the echo."""
        text = "".join(self.text)
        token_ids, logprobs, token_texts = self.token_ids, self.logprobs, self.token_texts
        first = not self.started
        if first and self.echo is not None:
            # A request aborted before its prompt ran has no prompt logprobs: nulls.
            echoed = prompt_logprobs or [None] * len(self.echo.token_ids)
            text = self.echo.text + text
            token_ids = self.echo.token_ids + token_ids
            logprobs = list(echoed) + logprobs
            unfiltered: list[str | None] = [None] * len(self.echo.token_ids)
            token_texts = unfiltered + token_texts
        shown = Shown(
            self.index,
            text,
            token_ids,
            logprobs if self.want_logprobs else None,
            self.finish_reason,
            self.stop_reason,
            prompt_logprobs if first else None,
            token_texts if any(t is not None for t in token_texts) else None,
        )
        self.started = True
        self.text, self.token_ids, self.logprobs, self.token_texts = [], [], [], []
        return shown


def clamp(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def completion_logprobs(
    state: ChoiceState, shown: Shown, decode: Callable[[int], str]
) -> CompletionLogprobs:
    """OpenAI's legacy shape: per token its text, logprob, the top alternatives (the chosen
    token and the top N, as vLLM) and its offset into the text. A token without a logprob
    (the first prompt token, when echoed) has nulls, as in OpenAI's API."""
    result = CompletionLogprobs()
    overrides = shown.token_texts or [None] * len(shown.token_ids)
    for token_id, entries, override in zip(
        shown.token_ids, shown.logprobs or [], overrides, strict=True
    ):
        if override is not None and entries is not None:
            # Filtered: the token's own text, and its alternatives', are not shown.
            text = override
            result.token_logprobs.append(clamp(entries[token_id].logprob))
            result.top_logprobs.append({})
        elif entries is None:
            text = decode(token_id)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = entries[token_id]
            text = _token_text(chosen, token_id, decode)
            result.token_logprobs.append(clamp(chosen.logprob))
            result.top_logprobs.append(
                {_token_text(e, t, decode): clamp(e.logprob) for t, e in entries.items()}
            )
        result.tokens.append(text)
        result.text_offset.append(state.text_offset)
        state.text_offset += len(text)
    return result


def chat_logprobs(shown: Shown, top: int, decode: Callable[[int], str]) -> ChatLogprobs:
    """OpenAI's chat shape: per token its text, bytes and logprob, and the ``top`` most likely
    alternatives in rank order."""
    content = []
    overrides = shown.token_texts or [None] * len(shown.token_ids)
    for token_id, entries, override in zip(
        shown.token_ids, shown.logprobs or [], overrides, strict=True
    ):
        assert entries is not None, "generated tokens always have logprobs"
        if override is not None:
            # Filtered: the token's own text, and its alternatives', are not shown.
            logprob = clamp(entries[token_id].logprob)
            content.append(
                ChatTokenLogprob(
                    token=override, logprob=logprob, bytes=list(override.encode()), top_logprobs=[]
                )
            )
            continue
        ranked = sorted(entries.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank))
        alternatives = []
        for alt_id, alt in ranked[:top]:
            text = _token_text(alt, alt_id, decode)
            alternatives.append(
                TopLogprob(token=text, logprob=clamp(alt.logprob), bytes=list(text.encode()))
            )
        chosen = entries[token_id]
        text = _token_text(chosen, token_id, decode)
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=clamp(chosen.logprob),
                bytes=list(text.encode()),
                top_logprobs=alternatives,
            )
        )
    return ChatLogprobs(content=content)


def prompt_logprobs(logprobs: PromptLogprobs | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` extension: per prompt token, {token id: {logprob, rank,
    decoded_token}} for the actual token and the top N; null for the first token."""
    if logprobs is None:
        return None
    return [
        None
        if entries is None
        else {
            token_id: PromptLogprob(
                logprob=clamp(e.logprob), rank=e.rank, decoded_token=e.decoded_token
            )
            for token_id, e in entries.items()
        }
        for entries in logprobs
    ]


def _token_text(entry: Logprob, token_id: int, decode: Callable[[int], str]) -> str:
    return entry.decoded_token if entry.decoded_token is not None else decode(token_id)
