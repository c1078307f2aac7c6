"""What is wrong with a request body that is not a JSON object, in the words both HTTP servers
(``ladle serve`` and ``ladle gateway``) answer with: where the JSON broke, or what came instead.

Only the standard library: the gateway runs without FastAPI.
"""

from __future__ import annotations

import json
from typing import Any

CODE = "invalid_json"
EMPTY = "the request body is empty: send a JSON object"


class BodyError(ValueError):
    """The body is not a JSON object; the message says why, for an OpenAI error (param null)."""


def broken(exc: json.JSONDecodeError) -> str:
    return (
        f"the request body is not valid JSON: {exc.msg} at line {exc.lineno}, column "
        f"{exc.colno} (character {exc.pos})"
    )


def not_an_object(value: Any) -> str:
    kind = {
        list: "an array",
        str: "a string",
        int: "a number",
        float: "a number",
        bool: "a boolean",
        type(None): "null",
    }.get(type(value), type(value).__name__)
    return f"the request body must be a JSON object ({{...}}), not {kind}"


def is_json(content_type: str | None) -> bool:
    """FastAPI's rule: no Content-Type, ``application/json`` or ``application/*+json``."""
    if not content_type:
        return True
    media = content_type.partition(";")[0].strip().lower()
    kind, _, subtype = media.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def wrong_content_type(content_type: str) -> str:
    media = content_type.partition(";")[0].strip()
    return (
        f"the request body must be JSON sent with Content-Type: application/json, not {media}"
        " (curl -d sends form data unless told: add -H 'Content-Type: application/json')"
    )


def parse_object(body: bytes, content_type: str | None = None) -> dict[str, Any]:
    if not is_json(content_type):
        raise BodyError(wrong_content_type(str(content_type)))
    if not body.strip():
        raise BodyError(EMPTY)
    try:
        doc = json.loads(body)
    except json.JSONDecodeError as exc:
        raise BodyError(broken(exc)) from None
    except UnicodeDecodeError:
        raise BodyError("the request body is not valid JSON: it is not UTF-8 text") from None
    if not isinstance(doc, dict):
        raise BodyError(not_an_object(doc))
    return doc
