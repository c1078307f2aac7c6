"""The counted nouns every message uses: "1 GPU", "2 GPUs", a verb agreeing where asked."""

from __future__ import annotations

from ladle.words import plural


def test_one_is_singular_and_every_other_count_plural() -> None:
    assert plural(1, "GPU") == "1 GPU"
    assert [plural(n, "replica") for n in (0, 2)] == ["0 replicas", "2 replicas"]
    assert plural(1, "GPU is", "GPUs are") == "1 GPU is"
    assert plural(3, "GPU is", "GPUs are") == "3 GPUs are"


def test_a_whole_float_counts_as_an_int() -> None:
    """Gauges (held requests) and limits (tokens per minute) arrive as floats."""
    assert plural(1.0, "request") == "1 request"
    assert plural(600.0, "token") == "600 tokens"
    assert plural(1_000_000.0, "token") == "1000000 tokens"
    assert plural(1.5, "request") == "1.5 requests"
