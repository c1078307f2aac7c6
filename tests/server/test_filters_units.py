"""Output filters on a stream, pure: whatever the chunking, the text shown is the text a whole
body shows; tokens and logprobs stay aligned with it; a stop ends it."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from ladle.runtime.config import ConfigError
from ladle.runtime.filters import Edit, FilterRequest, Rejected
from ladle.runtime.filters.loader import load
from ladle.runtime.filters.pii import PIIFilter, find
from ladle.runtime.filters.stream import FilteredText, Piece, merge_edits

TEXT = (
    "Sure! Write to jane.doe@example.com or call +1 415-555-0134 today. "
    "Card 4111 1111 1111 1111, SSN 123-45-6789, host 10.0.0.12. Thanks!"
)
REDACTED = (
    "Sure! Write to [EMAIL] or call [PHONE] today. Card [CARD], SSN [SSN], host [IP]. Thanks!"
)


def chunked(text: str, rng: random.Random) -> list[Piece]:
    """The text as deltas of 1-4 characters, each one or two tokens with a logprob each."""
    pieces, i, token = [], 0, 0
    while i < len(text):
        size = rng.randint(1, 4)
        tokens = list(range(token, token + rng.randint(1, 2)))
        token += len(tokens)
        pieces.append(Piece(text[i : i + size], tokens, [f"lp{t}" for t in tokens]))
        i += size
    return pieces


def run(filters: Sequence[object], pieces: list[Piece]) -> tuple[list[Piece], FilteredText]:
    applier = FilteredText(filters)  # type: ignore[arg-type]
    shown = []
    for i, piece in enumerate(pieces):
        shown += applier.push(piece, final=i == len(pieces) - 1)
    return shown, applier


def test_the_redactor_finds_each_kind() -> None:
    assert [label for _, _, label, _ in find(TEXT)] == ["EMAIL", "PHONE", "CARD", "SSN", "IP"]
    assert find("order 4111 1111 1111 1112 shipped") == []  # fails the Luhn check


@pytest.mark.parametrize("seed", range(8))
def test_any_chunking_shows_what_the_whole_body_shows(seed: int) -> None:
    pieces = chunked(TEXT, random.Random(seed))
    shown, applier = run([PIIFilter()], pieces)
    assert "".join(p.text for p in shown) == REDACTED
    whole, _ = run([PIIFilter()], [Piece(TEXT, [0], ["lp0"])])
    assert "".join(p.text for p in whole) == REDACTED
    # Every token is shown exactly once, in order, with its own logprob.
    ids = [t for p in shown for t in p.token_ids]
    assert ids == [t for p in pieces for t in p.token_ids]
    assert [lp for p in shown for lp in p.logprobs] == [f"lp{t}" for t in ids]
    # A replaced span's tokens carry its shown text (first token) and "" (the rest): the
    # tokens' texts still add up to the text, and none of them leaks what was replaced.
    texts = []
    for piece in shown:
        if piece.token_texts:
            assert len(piece.token_texts) == len(piece.token_ids)
            texts += [t for t in piece.token_texts if t is not None]
        else:
            texts.append(piece.text)
    assert "".join(texts) == REDACTED
    assert applier.changed_by == {"pii"}


def test_plain_text_is_not_held_back_past_the_current_word() -> None:
    applier = FilteredText([PIIFilter()])
    assert [p.text for p in applier.push(Piece("Hello there, ", [1]), final=False)] == [
        "Hello there, "
    ]
    assert applier.push(Piece("frie", [2]), final=False) == []  # could become anything
    assert [p.text for p in applier.push(Piece("nd. ", [3]), final=False)] == ["frie", "nd. "]
    # Digits with phone punctuation wait across spaces: "+1 415" may become a number.
    assert applier.push(Piece("+1 415 ", [4]), final=False) == []
    assert [p.text for p in applier.push(Piece("is all.", [5]), final=True)] == [
        "+1 415 ",
        "is all.",
    ]


class StopAtSecret:
    name = "secrets"

    def scan(self, text: str, start: int) -> list[Edit]:
        at = text.find("SECRET", start)
        return [] if at < 0 else [Edit(at, len(text), stop=True)]

    def settled(self, text: str) -> int:
        return len(text) - 5  # "SECRE" might be the start of it


def test_a_stop_ends_the_text_inside_the_delta_that_holds_it() -> None:
    pieces = [Piece("The code is SEC", [1, 2, 3]), Piece("RET-42 and more", [4, 5])]
    applier = FilteredText([StopAtSecret(), PIIFilter()])
    # A delta moves whole: this one ends in what may be the start of a secret, so it waits.
    assert applier.push(pieces[0], final=False) == []
    shown = applier.push(pieces[1], final=False)
    assert [p.text for p in shown] == ["The code is "]
    assert applier.stopped_by == "secrets"
    # The delta that holds the stop keeps its tokens (as a stop string's do); later ones go.
    assert [t for p in shown for t in p.token_ids] == [1, 2, 3]
    assert shown[0].token_texts == ["The code is ", "", ""]
    assert applier.push(Piece(" even more", [6]), final=True) == []


def test_a_stop_inside_a_replaced_span_ends_where_the_span_begins() -> None:
    edits = merge_edits([Edit(5, 20, "[X]", by="a"), Edit(8, 30, stop=True, by="b")])
    assert edits == [Edit(5, 30, stop=True, by="b")]


def test_the_redactor_as_an_input_filter_refuses_a_prompt_naming_what_it_found() -> None:
    request = FilterRequest("/v1/chat/completions", "m", ["mail me at a.b@example.org"], [])
    with pytest.raises(Rejected, match="the messages holds an e-mail address"):
        PIIFilter().check(request)
    PIIFilter().check(FilterRequest("/v1/completions", "m", ["nothing personal here"]))


def test_filters_load_by_name_or_import_path_and_say_what_is_wrong() -> None:
    assert isinstance(load("pii", "input"), PIIFilter)
    assert isinstance(load("ladle.runtime.filters.pii:PIIFilter", "output"), PIIFilter)
    with pytest.raises(ConfigError, match=r"no such filter.*known: pii"):
        load("pi", "output")
    with pytest.raises(ConfigError, match="has no 'Nope'"):
        load("ladle.runtime.filters.pii:Nope", "output")
    with pytest.raises(ConfigError, match="cannot be an output filter"):
        load("ladle.runtime.filters.pii:MAX_HOLD", "output")
    with pytest.raises(ConfigError, match=r"could not be created: .*missing"):
        load("ladle.runtime.filters:FilterRequest", "input")


def test_a_filter_that_settles_nothing_yet_holds_everything_back() -> None:
    applier = FilteredText([StopAtSecret()])
    assert applier.push(Piece("Hi", [1]), final=False) == []  # settled() is negative here
    assert [p.text for p in applier.push(Piece(" there", [2]), final=True)] == ["Hi", " there"]
