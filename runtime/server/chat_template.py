"""The model's chat template: messages → the prompt text the model reads, and its tokens.

Used by /v1/chat/completions and by /tokenize, which must count exactly what chat would send.
"""

from __future__ import annotations

from typing import Any

from ladle.runtime.errors import RequestError, require_text
from ladle.runtime.server.protocol import (
    ChatMessage,
)


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any] | None,
) -> tuple[str, list[int]]:
    """Apply the model's chat template; a template that rejects the messages is a 400."""
    from jinja2 import TemplateError

    if tokenizer.chat_template is None:
        raise RequestError("this model has no chat template; use /v1/completions", "messages")
    try:
        rendered = tokenizer.apply_chat_template(
            [m.for_template() for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError) as exc:
        raise RequestError(f"the chat template rejected the messages: {exc}", "messages") from None
    if not isinstance(rendered, str):
        raise RequestError("chat_template_kwargs: the template must render text", "messages")
    require_text(rendered, "messages")
    return rendered, list(tokenizer.encode(rendered, add_special_tokens=False))
