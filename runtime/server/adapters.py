"""The LoRA adapters a server serves by name: the OpenAI ``model`` of a request picks one, and
vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` change the set while the
server runs.

An adapter is read and checked off the event loop and off the engine's thread, then handed
to the engine between two steps, so that neither the API nor the batch waits on its files.

``--lora-modules-file`` names a file (a mounted ConfigMap, which the operator writes from
``spec.adapters``) that the server reads again whenever it changes: adapters added to it are
loaded, removed ones unloaded, and one whose folder changed is loaded again, with no restart.
One that cannot be served is reported (a log line, ``ladle:lora_adapters{state="failed"}``,
and with why in ``GET /v1/lora_adapters``) while the rest, and the base model, keep serving.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

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


@dataclass(frozen=True)
class Failure:
    """An adapter of the modules file that cannot be served: its folder, and why."""

    path: str
    error: str


class ModulesFileError(ValueError):
    """A --lora-modules-file that does not hold a list of {name, path}."""


def read_modules_file(path: Path) -> dict[str, str]:
    """name -> folder, from a YAML (or JSON) list of ``{name: ..., path: ...}``."""
    try:
        entries = yaml.safe_load(path.read_text()) or []
    except (OSError, yaml.YAMLError) as exc:
        raise ModulesFileError(f"{path}: cannot read it: {exc}") from None
    modules: dict[str, str] = {}
    if not isinstance(entries, list):
        raise ModulesFileError(f"{path}: expected a list of {{name, path}}")
    for i, entry in enumerate(entries):
        name = entry.get("name") if isinstance(entry, dict) else None
        folder = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(name, str) or not isinstance(folder, str) or not name or not folder:
            raise ModulesFileError(f"{path}: entry {i} needs a name and a path")
        if name in modules:
            raise ModulesFileError(f"{path}: the adapter {name!r} is listed twice")
        modules[name] = folder
    return modules


class ServedAdapters:
    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        # Adapters the modules file asked for: the ones a later version of it may remove.
        self._from_file: dict[str, str] = {}
        # Adapters of the modules file that could not be served, with why.
        self.failed: dict[str, Failure] = {}
        self._ids = itertools.count(1)
        # Loads and unloads one at a time, so that two loads of one name cannot both pass.
        self._lock = asyncio.Lock()

    @property
    def names(self) -> list[str]:
        return sorted(self._by_name)

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def report(self) -> dict[str, list[dict[str, str]]]:
        """``GET /v1/lora_adapters``: what this pod serves and what it cannot, with why (the
        operator's status of each pod reads it)."""
        return {
            "loaded": [{"name": n, "path": self._by_name[n].lora_path} for n in self.names],
            "failed": [
                {"name": n, "path": f.path, "error": f.error}
                for n, f in sorted(self.failed.items())
            ],
        }

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

    async def sync(self, llm: AsyncLLM, wanted: dict[str, str]) -> None:
        """Serve exactly the modules file's adapters (besides those loaded through the API):
        unload the ones it dropped or moved, then load the ones it added or moved."""
        for name, folder in list(self._from_file.items()):
            if wanted.get(name) != folder:
                del self._from_file[name]
                if name in self._by_name:
                    await self.unload(llm, name)
        for name in list(self.failed):
            if name not in wanted:
                del self.failed[name]
        for name, folder in wanted.items():
            if name in self._from_file:
                continue
            try:
                await self.load(llm, name, folder)
            except APIError as exc:
                self.failed[name] = Failure(folder, exc.message)
                log.error(
                    "a LoRA adapter of the modules file cannot be served",
                    extra={"lora_name": name, "lora_path": folder, "error": exc.message},
                )
                continue
            self.failed.pop(name, None)
            self._from_file[name] = folder

    async def watch(self, llm: AsyncLLM, path: Path, seen: str, interval: float) -> None:
        """Sync with the file whenever its content changes from ``seen`` (a ConfigMap's
        update swaps a symlink, so the content, not the mtime, is what tells)."""
        while True:
            await asyncio.sleep(interval)
            try:
                text = path.read_text()
            except OSError as exc:
                text = f"unreadable: {exc}"
            if text != seen:
                seen = text
                try:
                    wanted = read_modules_file(path)
                except ModulesFileError as exc:
                    log.error("the LoRA modules file is not valid; adapters stay as they are",
                              extra={"error": str(exc)})  # fmt: skip
                else:
                    await self.sync(llm, wanted)

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
