"""``pii``: a regex redactor of personal data, shipped as the example filter.

As an output filter it replaces e-mail addresses, phone numbers, payment card numbers (those
that pass the Luhn check), US social security numbers and IPv4 addresses with ``[EMAIL]``,
``[PHONE]``, ``[CARD]``, ``[SSN]`` and ``[IP]``, also when one arrives over several chunks of a
stream. As an input filter it refuses a prompt that holds any of them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ladle.runtime.filters import Edit, FilterRequest, Rejected

_PATTERNS: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    (
        "EMAIL",
        "an e-mail address",
        re.compile(r"[\w.%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"),
    ),
    ("SSN", "a social security number", re.compile(r"(?<!\d)\d{3}-\d{2}-\d{4}(?!\d)")),
    ("CARD", "a payment card number", re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")),
    (
        "IP",
        "an IP address",
        re.compile(
            r"(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)"
            r"(?![\d.]*\d)"
        ),
    ),
    (
        "PHONE",
        "a phone number",
        re.compile(
            r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{3}\)|\d{3})[ .-]?\d{3}[ .-]?\d{4}(?!\d)"
        ),
    ),
)  # fmt: skip
# What a match may still be growing from: the last word, and before it any words made of
# digits and phone punctuation ("+1 415 555" may become a phone number).
_TAIL = re.compile(r"(?:[().+-]*\d[\d().+-]* )*\S*\Z")
# The most characters held back from a stream while a match may still grow.
MAX_HOLD = 256


def _luhn(number: str) -> bool:
    digits = [int(d) for d in number if d.isdigit()]
    total = 0
    for i, digit in enumerate(reversed(digits)):
        doubled = digit * 2 if i % 2 else digit
        total += doubled - 9 if doubled > 9 else doubled
    return total % 10 == 0


def find(text: str, start: int = 0) -> list[tuple[int, int, str, str]]:
    """Each piece of personal data from ``start`` on: (start, end, label, what it is), in
    order, not overlapping (at one place, the first pattern listed wins)."""
    found = []
    for label, what, pattern in _PATTERNS:
        for match in pattern.finditer(text, start):
            if label == "CARD" and not _luhn(match.group()):
                continue
            found.append((match.start(), match.end(), label, what))
    found.sort()
    kept: list[tuple[int, int, str, str]] = []
    for item in found:
        if not kept or item[0] >= kept[-1][1]:
            kept.append(item)
    return kept


class PIIFilter:
    name = "pii"

    def scan(self, text: str, start: int) -> Sequence[Edit]:
        return [Edit(s, e, f"[{label}]") for s, e, label, _ in find(text, start)]

    def settled(self, text: str) -> int:
        window = text[-MAX_HOLD:]
        tail = _TAIL.search(window)
        held = len(tail.group()) if tail is not None else 0
        return len(text) - held

    def check(self, request: FilterRequest) -> None:
        for prompt in request.prompts:
            found = find(prompt)
            if found:
                where = "messages" if request.messages is not None else "prompt"
                raise Rejected(f"the {where} holds {found[0][3]}", where)
