"""The Ladle runtime: a paged-KV, continuous-batching LLM engine and its OpenAI server.

``from ladle.runtime import LLM, SamplingParams`` mirrors vLLM's offline API. Names are
resolved lazily so that CLI subcommands that do not need torch never import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ladle.runtime.async_engine import AsyncLLM
    from ladle.runtime.config import EngineArgs
    from ladle.runtime.engine import LLMEngine
    from ladle.runtime.llm import LLM
    from ladle.runtime.lora.request import LoRARequest
    from ladle.runtime.outputs import CompletionOutput, RequestOutput
    from ladle.runtime.sampling_params import SamplingParams

_EXPORTS = {
    "AsyncLLM": "ladle.runtime.async_engine",
    "CompletionOutput": "ladle.runtime.outputs",
    "EngineArgs": "ladle.runtime.config",
    "LLM": "ladle.runtime.llm",
    "LLMEngine": "ladle.runtime.engine",
    "LoRARequest": "ladle.runtime.lora.request",
    "RequestOutput": "ladle.runtime.outputs",
    "SamplingParams": "ladle.runtime.sampling_params",
}
__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "LoRARequest",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
