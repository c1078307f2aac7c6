"""The gateway's half of the audit trail (``ladle.audit``): one record per proxied request,
built from what the data path found out (key, route, pod, outcome, usage), joined to the pod's
record by the request id the gateway sent it."""

from __future__ import annotations

import json
from typing import Any

from ladle.audit import outcome
from ladle.gateway.apikeys import ApiKey
from ladle.gateway.context import Outcome
from ladle.gateway.inbound import Inbound

# Body fields that are not parameters: what is routed, and the text (recorded only on opt-in).
_NOT_PARAMS = frozenset({"model", "messages", "prompt", "stream"})


def fields(
    path: str,
    out: Outcome,
    key: ApiKey | None,
    inbound: Inbound | None,
    duration: float,
    text: bool,
) -> dict[str, Any]:
    svc = out.service
    record: dict[str, Any] = {
        "key": None if key is None else key.name,
        "endpoint": path,
        "model": None if inbound is None else inbound.model,
        "params": None if inbound is None else _params(inbound.doc),
        "stream": None if inbound is None else inbound.stream,
        "status": out.status,
        "outcome": outcome(out.status),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": out.completion_tokens,
        "duration_s": round(duration, 4),
        "ttfb_s": None if out.ttfb is None else round(out.ttfb, 4),
        "namespace": None if svc is None else svc.namespace,
        "service": None if svc is None else svc.name,
        "variant": out.variant or None,
        "pod": out.pod or None,
        "attempts": out.attempts,
    }
    if out.cache is not None:
        record["cache"] = out.cache
    if out.fallback_from:
        record["fallback_from"] = out.fallback_from
    if out.error:
        record["error"] = out.error
    if text:
        record["prompt"] = None if inbound is None else prompt_text(inbound.doc)
        record["output"] = output_text(
            b"".join(out.captured or []), bool(inbound and inbound.stream)
        )
    return record


def _params(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sorted(doc.items()) if k not in _NOT_PARAMS}


def prompt_text(doc: dict[str, Any]) -> list[Any]:
    """The messages (chat) or the prompts (completions), as the client sent them."""
    if "messages" in doc:
        messages = doc["messages"]
        return list(messages) if isinstance(messages, list) else [messages]
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return prompt
    return [prompt]


def output_text(body: bytes, stream: bool) -> list[str]:
    """Each choice's text from a response body, or from a stream's events joined up."""
    docs: list[Any] = []
    if stream:
        for event in body.split(b"\n\n"):
            if event.startswith(b"data: {"):
                try:
                    docs.append(json.loads(event[6:]))
                except ValueError:
                    continue
    else:
        try:
            docs.append(json.loads(body))
        except ValueError:
            return []
    texts: dict[int, list[str]] = {}
    for doc in docs:
        for choice in doc.get("choices") or () if isinstance(doc, dict) else ():
            if not isinstance(choice, dict):
                continue
            part = choice.get("delta") or choice.get("message") or {}
            piece = part.get("content") if isinstance(part, dict) else None
            if piece is None:
                piece = choice.get("text")
            if isinstance(piece, str):
                texts.setdefault(int(choice.get("index") or 0), []).append(piece)
    return ["".join(texts[i]) for i in sorted(texts)]
