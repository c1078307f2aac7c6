"""Incremental detokenization: streamed deltas add up to the full decode, and stop strings are
caught across token boundaries without any part of them ever being shown."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ladle.runtime.detokenizer import IncrementalDetokenizer

PROMPT = "User: write something.\nAssistant:"
VOCAB = 49152
SPECIAL_IDS = [0, 1, 2, 3, 4]

# ASCII, accented Latin, CJK, emoji (4-byte UTF-8, with skin tones and ZWJ sequences).
characters = st.one_of(
    st.characters(min_codepoint=0x20, max_codepoint=0x7E),
    st.sampled_from(list("éàüßøœ\n\t")),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x4FFF),
    st.sampled_from(["😀", "👍🏽", "👩\u200d💻", "🇫🇷", "🤖", "ℹ️"]),
)
texts = st.lists(characters, min_size=1, max_size=40).map("".join)
# Raw ids: anything in the vocabulary, which includes lone UTF-8 byte tokens, plus specials.
raw_ids = st.lists(
    st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(SPECIAL_IDS)), min_size=1, max_size=30
)
slow = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def stream(
    tokenizer: Any, ids: list[int], chunks: list[int], detok: IncrementalDetokenizer
) -> list[str]:
    """Feed ids in chunks of the given sizes (cycled), then finish; return what was shown."""
    shown: list[str] = []
    i = 0
    k = 0
    while i < len(ids):
        size = chunks[k % len(chunks)]
        k += 1
        part = ids[i : i + size]
        i += size
        last = i >= len(ids)
        detok.update(part, final=last)
        shown.append(detok.output_text(finished=last or detok.stopped))
        if detok.stopped:
            break
    return shown


def assert_prefixes(shown: list[str]) -> None:
    """What a client sees only ever grows: each output extends the previous one."""
    for before, after in itertools.pairwise(shown):
        assert after.startswith(before)


@slow
@given(text=texts, chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_deltas_of_encoded_text_add_up_to_the_text(
    tokenizer: Any, text: str, chunks: list[int]
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(PROMPT))
    shown = stream(tokenizer, ids, chunks, detok)
    assert_prefixes(shown)
    assert shown[-1] == tokenizer.decode(ids) == text


@slow
@given(ids=raw_ids, skip=st.booleans(), chunks=st.lists(st.integers(1, 3), min_size=1))
def test_deltas_of_any_token_stream_add_up_to_the_full_decode(
    tokenizer: Any, ids: list[int], skip: bool, chunks: list[int]
) -> None:
    detok = IncrementalDetokenizer(tokenizer, [1, 9690, 198], skip_special_tokens=skip)
    shown = stream(tokenizer, ids, chunks, detok)
    assert_prefixes(shown)
    assert shown[-1] == tokenizer.decode(ids, skip_special_tokens=skip)


def test_a_split_multibyte_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode(" 😀", add_special_tokens=False)
    assert len(ids) == 2  # the emoji's four bytes are split over two tokens
    detok = IncrementalDetokenizer(tokenizer, [1])
    detok.update(ids[:1])
    assert detok.text == ""
    detok.update(ids[1:])
    assert detok.text == " 😀"


@slow
@given(
    text=texts,
    cut=st.integers(0, 99),
    length=st.integers(1, 6),
    include=st.booleans(),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_stop_strings_are_caught_and_never_shown(
    tokenizer: Any, text: str, cut: int, length: int, include: bool, chunks: list[int]
) -> None:
    stop = text[cut % len(text) :][:length]
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(
        tokenizer, [1], stop=[stop, "\x00never"], include_stop_str_in_output=include
    )
    shown = stream(tokenizer, ids, chunks, detok)
    assert_prefixes(shown)
    at = text.find(stop)
    assert detok.stopped
    assert shown[-1] == (text[: at + len(stop)] if include else text[:at])
    if not include:
        # No streamed text ever held the stop string or any part of it at its end.
        for seen in shown:
            assert len(seen) <= at


def test_a_stop_string_split_across_tokens_is_held_back_then_cut(tokenizer: Any) -> None:
    text = " Hello world. The end"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[:4] == [" Hello", " world", ".", " The"]
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["ld. T"])
    views = []
    for token in ids:
        stop = detok.update([token])
        views.append(detok.output_text(finished=stop is not None))
        if stop is not None:
            break
    # " world" ends in "ld", a possible start of the stop string: held back, then cut.
    assert views == [" Hello", " Hello wor", " Hello wor", " Hello wor"]
    assert detok.stopped
    assert detok.text == " Hello wor"


def test_a_stop_string_that_does_not_complete_is_released(tokenizer: Any) -> None:
    ids = tokenizer.encode(" world. Then", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["ld!"])
    detok.update(ids[:1])
    assert detok.output_text(finished=False) == " wor"
    detok.update(ids[1:])
    assert detok.output_text(finished=False) == " world. Then"


def test_stop_string_check_can_be_deferred(tokenizer: Any) -> None:
    """The engine skips the check while ``min_tokens`` is not reached."""
    ids = tokenizer.encode(" stop here stop", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [1], stop=["stop"])
    assert detok.update(ids[:1], check_stop=False) is None
    assert detok.update(ids[1:]) == "stop"
    assert detok.text == " stop here "


def test_special_tokens_are_kept_or_skipped(tokenizer: Any) -> None:
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), 2, 2]
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=True)
    for token in ids:
        kept.update([token])
        skipped.update([token])
    assert kept.text == "Hi<|im_end|><|im_end|>"
    assert skipped.text == "Hi"


@pytest.fixture(scope="module")
def wordpiece() -> PreTrainedTokenizerFast:
    """A tokenizer whose decoder puts spaces between tokens, where the flag matters."""
    vocab = {"[UNK]": 0, "[A]": 1, "[B]": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", additional_special_tokens=["[A]", "[B]"]
    )


@pytest.mark.parametrize(
    ("spaces", "expected"), [(True, " hello [A] [B] world"), (False, " hello[A][B]world")]
)
def test_spaces_between_special_tokens(
    wordpiece: PreTrainedTokenizerFast, spaces: bool, expected: str
) -> None:
    detok = IncrementalDetokenizer(
        wordpiece, [3], skip_special_tokens=False, spaces_between_special_tokens=spaces
    )
    for token in [3, 1, 2, 4]:
        detok.update([token])
    detok.update([], final=True)
    assert detok.text == expected
