"""The LoRA adapters a server serves by name: the OpenAI ``model`` of a request picks one, and
vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change the set while the
server runs.

An adapter is read and checked off the event loop and off the engine's thread, then handed
to the engine between two steps, so that neither the API nor the batch waits on its files.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ladle.runtime.lora.adapter import LoRAError
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.server.errors import APIError

if TYPE_CHECKING:
    from ladle.runtime.async_engine import AsyncLLM

log = logging.getLogger("ladle.server")


@dataclass(frozen=True)
class Target:
    """What a request's ``model`` names: the name responses carry, and the adapter that runs
    on the base model (None: the base model alone)."""

    name: str
    lora: LoRARequest | None = None


class ServedAdapters:
    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        # Loads and unloads one at a time, so that two loads of one name cannot both pass.
        self._lock = asyncio.Lock()

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def resolve(self, llm: AsyncLLM, name: str | None) -> Target:
        """What a request's ``model`` names; an unknown name is a 404, as OpenAI and vLLM
        answer."""
        served = llm.engine.served_model_name
        if name is None or name == served:
            return Target(served)
        adapter = self._by_name.get(name)
        if adapter is None:
            known = ", ".join(repr(n) for n in [served, *self.names])
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {known}",
                code="model_not_found",
                param="model",
            )
        return Target(name, adapter)

    async def load(self, llm: AsyncLLM, name: str, path: str) -> LoRARequest:
        engine = llm.engine
        if engine.lora is None:
            raise APIError(
                400,
                "LoRA is off on this server; start it with --enable-lora",
                code="lora_disabled",
            )
        manager = engine.lora
        async with self._lock:
            if name == engine.served_model_name:
                raise APIError(
                    400,
                    f"lora_name: {name!r} is the base model's name; give the adapter another",
                    code="invalid_parameter",
                    param="lora_name",
                )
            if name in self._by_name:
                raise APIError(
                    400,
                    f"lora_name: the adapter {name!r} is already loaded; unload it first",
                    code="invalid_parameter",
                    param="lora_name",
                )
            request = LoRARequest(name, next(self._ids), path)
            try:
                adapter = await asyncio.to_thread(manager.load, request)
            except LoRAError as exc:
                raise APIError(400, str(exc), code="invalid_lora", param="lora_path") from None
            await llm.call(lambda: engine.add_lora(request, adapter))
            self._by_name[name] = request
        log.info(
            "LoRA adapter loaded",
            extra={"lora_name": name, "lora_path": path, "rank": adapter.rank},
        )
        return request

    async def unload(self, llm: AsyncLLM, name: str) -> None:
        """Requests already admitted finish with the adapter; new ones get a 404."""
        async with self._lock:
            request = self._by_name.pop(name, None)
            if request is None:
                raise APIError(
                    404,
                    f"lora_name: no adapter {name!r} is loaded",
                    code="model_not_found",
                    param="lora_name",
                )
            await llm.call(lambda: llm.engine.remove_lora(request.lora_int_id))
        log.info("LoRA adapter unloaded", extra={"lora_name": name})
