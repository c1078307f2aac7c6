"""The texts a comparison scores: our default set, or a user's file.

The default set (``prompts.json``) is ours, written for this purpose: English prose,
dialogue, lists and arithmetic, seven other languages (French, German, Spanish, Italian,
Portuguese, Chinese, Japanese, Russian) and code in seven languages, about 4,800 tokens in all
with SmolLM2's tokenizer. It shares nothing with the quantization calibration text (the Python
language reference), so calibrated methods are not scored on what they were fitted to.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).with_name("prompts.json")


class PromptFileError(ValueError):
    """A prompt file that cannot be read; the message says what to fix."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    kind: str = "user"


def _entry(value: object, where: str, index: int) -> Prompt:
    if isinstance(value, str):
        text, pid, kind = value, f"prompt-{index + 1}", "user"
    elif isinstance(value, dict) and isinstance(value.get("prompt"), str):
        text = value["prompt"]
        pid = str(value.get("id", f"prompt-{index + 1}"))
        kind = str(value.get("kind", "user"))
    else:
        raise PromptFileError(f'{where}: expected a string or an object with a "prompt" string')
    if not text.strip():
        raise PromptFileError(f"{where}: the prompt is empty")
    return Prompt(pid, text, kind)


def load_prompts(path: Path | None = None) -> list[Prompt]:
    """Read prompts: a ``.json`` list, ``.jsonl`` lines (each a string or an object with a
    ``"prompt"`` string, optionally ``"id"`` and ``"kind"``), or any other text file with one
    prompt per non-empty line. Without a path, the default set."""
    path = path or DEFAULT_PROMPTS
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read prompt file {path}: {exc}") from None
    return parse_prompts(raw, path)


def parse_prompts(raw: str, path: Path) -> list[Prompt]:
    """Prompts from text already read (a ConfigMap key, for the operator, whose filesystem is
    read-only); ``path``'s suffix says the format, as for :func:`load_prompts`."""
    try:
        if path.suffix == ".json":
            items = json.loads(raw)
            if not isinstance(items, list):
                raise PromptFileError(f"{path}: a .json prompt file holds a list")
            prompts = [_entry(v, f"{path}: item {i + 1}", i) for i, v in enumerate(items)]
        elif path.suffix == ".jsonl":
            lines = [(n, line) for n, line in enumerate(raw.splitlines(), 1) if line.strip()]
            prompts = [
                _entry(json.loads(line), f"{path}:{n}", i) for i, (n, line) in enumerate(lines)
            ]
        else:
            texts = [line for line in raw.splitlines() if line.strip()]
            prompts = [Prompt(f"prompt-{i + 1}", text) for i, text in enumerate(texts)]
    except json.JSONDecodeError as exc:
        raise PromptFileError(f"{path}: invalid JSON ({exc})") from None
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts
