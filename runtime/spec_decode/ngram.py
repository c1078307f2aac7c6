"""Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's
last n tokens, for the largest n that occurs (vLLM's ``ngram`` proposer). It needs no weights
and pays off where the output repeats its input: summaries, edits, answers quoting a
retrieved passage."""

from __future__ import annotations

import array
from collections.abc import Sequence

_WIDTH = array.array("i").itemsize


def propose(tokens: Sequence[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to ``k`` draft tokens continuing ``tokens`` (none when no n-gram recurs).

    The search runs in ``bytes.rfind`` over the tokens packed as 32-bit integers (a step
    searches every sequence's whole history), keeping only matches on token boundaries."""
    length = len(tokens)
    data = array.array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = data[(length - n) * _WIDTH :]
        # A match must end before the last token, so that something follows it.
        end = (length - 1) * _WIDTH
        while (found := data.rfind(tail, 0, end)) >= 0:
            if found % _WIDTH == 0:
                start = found // _WIDTH + n
                return list(tokens[start : start + k])
            end = found + len(tail) - 1
    return []
