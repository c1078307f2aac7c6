"""OpenAI request fields → the engine's ``SamplingParams`` or ``BeamSearchParams``, by name.

Also the two views of parameters the rest of the server needs: what a request's log line and
filters see (``public_params``), and how many sequences one prompt runs (``seqs_per_prompt``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from pydantic import TypeAdapter, ValidationError

from ladle.runtime.errors import RequestError
from ladle.runtime.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from ladle.runtime.server.errors import from_validation_errors
from ladle.runtime.server.protocol import (
    _GenerationRequest,
)

# Request fields the server consumes itself; every other field must be a SamplingParams field.
_SERVER_FIELDS = frozenset(
    {
        "model",
        "stream",
        "stream_options",
        "priority",
        "prompt",
        "echo",
        "suffix",
        "messages",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "use_beam_search",
        "timeout",
    }
)
# Accepted for client compatibility; they do not change what is generated.
_IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})


@functools.cache
def _sampling_adapter() -> TypeAdapter[SamplingParams]:
    return TypeAdapter(SamplingParams)


@functools.cache
def _sampling_fields() -> frozenset[str]:
    """What a client may set: every constructor field except the server's output mode."""
    fields = dataclasses.fields(SamplingParams)
    return frozenset(f.name for f in fields if f.init and f.name != "output_kind")


def build_sampling_params(request: _GenerationRequest, overrides: dict[str, Any]) -> SamplingParams:
    """Map the request's fields onto ``SamplingParams`` by name.

    vLLM's extras arrive as extra body fields and pass through the same way, so a field added
    to ``SamplingParams`` is served with no change here. Unknown fields are refused by name.
    """
    given = {name: getattr(request, name) for name in request.model_fields_set}
    given.update(request.model_extra or {})
    kwargs = {
        k: v
        for k, v in given.items()
        if k not in _SERVER_FIELDS and k not in _IGNORED_FIELDS and v is not None
    }
    kwargs.update(overrides)
    if isinstance(kwargs.get("stop"), str):
        kwargs["stop"] = [kwargs["stop"]]
    unknown = sorted(set(kwargs) - _sampling_fields())
    if unknown:
        raise RequestError(f"{unknown[0]}: not supported by this server", unknown[0])
    kwargs["output_kind"] = RequestOutputKind.DELTA
    try:
        return _sampling_adapter().validate_python(kwargs)
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


def build_beam_params(
    request: _GenerationRequest, max_tokens: int | None, default_max_tokens: int
) -> BeamSearchParams:
    """vLLM's ``use_beam_search``: ``n`` beams, best first. As in vLLM, the sampling fields
    other than the beam search's own do not apply and are ignored."""
    extra = request.model_extra or {}
    kwargs = {k: extra[k] for k in ("length_penalty", "early_stopping") if k in extra}
    try:
        return _beam_adapter().validate_python(
            {
                "beam_width": request.n,
                "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
                "ignore_eos": extra.get("ignore_eos", False),
                **kwargs,
            }
        )
    except ValidationError as exc:
        raise from_validation_errors(list(exc.errors())) from None


@functools.cache
def _beam_adapter() -> TypeAdapter[BeamSearchParams]:
    return TypeAdapter(BeamSearchParams)


def public_params(params: SamplingParams | BeamSearchParams) -> dict[str, Any]:
    """The settings that shaped this request, for its log line: temperature and max_tokens
    always, the rest where they differ from the defaults."""
    if isinstance(params, BeamSearchParams):
        return {"use_beam_search": True, **dataclasses.asdict(params)}
    defaults = _default_params()
    return {
        name: getattr(params, name)
        for name in sorted(_sampling_fields())
        if name in ("temperature", "max_tokens") or getattr(params, name) != defaults[name]
    }


@functools.cache
def _default_params() -> dict[str, Any]:
    params = SamplingParams()
    return {name: getattr(params, name) for name in _sampling_fields()}


def wants_beam_search(request: _GenerationRequest) -> bool:
    return bool((request.model_extra or {}).get("use_beam_search", False))


def seqs_per_prompt(params: SamplingParams | BeamSearchParams) -> int:
    """Sequences one prompt runs: its n or best_of samples, or its beams."""
    return params.beam_width if isinstance(params, BeamSearchParams) else params.num_samples
