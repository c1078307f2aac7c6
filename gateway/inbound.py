"""What the gateway reads from a client's JSON body: the model to route by, whether it
streams, the session key for a sticky canary split and the prompt prefix for pod affinity.

The body is forwarded as received unless something must change (the model name on fallback,
usage reporting for a token-limited key, the engine's priority for a band other than the
default), and then it is re-serialized once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ladle import json_body
from ladle.gateway.errors import GatewayError


@dataclass
class Inbound:
    body: bytes
    doc: dict[str, Any]
    model: str
    stream: bool

    @classmethod
    def parse(cls, body: bytes, content_type: str | None = None) -> Inbound:
        try:
            doc = json_body.parse_object(body, content_type)
        except json_body.BodyError as exc:
            raise GatewayError(400, str(exc), json_body.CODE) from None
        model = doc.get("model")
        if not isinstance(model, str) or not model:
            raise GatewayError(
                400,
                "model is required: the gateway routes by it (GET /v1/models lists them)",
                "model_required",
                param="model",
            )
        return cls(body, doc, model, doc.get("stream") is True)

    def session_key(self, header: bytes | None) -> bytes | None:
        """``x-session-id``, else the body's ``user``: what keeps a client on one variant."""
        if header:
            return header
        user = self.doc.get("user")
        return user.encode() if isinstance(user, str) and user else None

    def prefix(self, chars: int) -> bytes | None:
        """The first ``chars`` characters of the prompt (all messages, in order, for chat)."""
        if "messages" in self.doc:
            return _messages_prefix(self.doc["messages"], chars)
        prompt = self.doc.get("prompt")
        if isinstance(prompt, list) and prompt:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt[:chars].encode() if prompt else None
        if isinstance(prompt, list) and prompt:  # token ids: about four characters each
            return json.dumps(prompt[: max(1, chars // 4)]).encode()
        return None

    @property
    def wants_usage(self) -> bool:
        options = self.doc.get("stream_options")
        return isinstance(options, dict) and options.get("include_usage") is True

    def rewritten(
        self, model: str | None = None, include_usage: bool = False, priority: int | None = None
    ) -> bytes:
        """The body to forward, changed only where it must be. ``priority`` (None: leave it) is
        the engine's, set by the gateway's band: a client's own would jump its band, so it is
        replaced, and the default band's 0 is the engine's default, sent as no field."""
        reprioritised = priority is not None and (priority != 0 or "priority" in self.doc)
        if model is None and not include_usage and not reprioritised:
            return self.body
        doc = dict(self.doc)
        if model is not None:
            doc["model"] = model
        if include_usage:
            doc["stream_options"] = {**(doc.get("stream_options") or {}), "include_usage": True}
        if reprioritised:
            if priority:
                doc["priority"] = priority
            else:
                del doc["priority"]
        return json.dumps(doc).encode()


def _messages_prefix(messages: Any, chars: int) -> bytes | None:
    if not isinstance(messages, list):
        return None
    parts: list[str] = []
    size = 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if not isinstance(content, str):
            continue
        text = f"{message.get('role', '')}:{content}\n"
        parts.append(text)
        size += len(text)
        if size >= chars:
            break
    joined = "".join(parts)[:chars]
    return joined.encode() if joined else None
