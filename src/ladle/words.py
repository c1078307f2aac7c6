"""Counted nouns for messages a person reads: "1 GPU", "2 GPUs", never "1 GPUs".

Standard library only, and imported by every part (the server, the gateway, the operator, the
local cluster's node agent), so that each says it the same way."""

from __future__ import annotations


def plural(count: float, word: str, words: str | None = None) -> str:
    """``count`` and the noun agreeing with it: ``words`` where adding "s" is wrong, or where a
    verb agrees too (``plural(n, "GPU is", "GPUs are")``). A whole float prints as an int."""
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    number = f"{count:g}" if isinstance(count, float) else str(count)
    return f"{number} {word if count == 1 else (words or word + 's')}"
