"""Which adapters the engine serves, which of them are in CPU memory, and which sit in the
device slots: both caches least recently used first, as vLLM's LRU LoRA managers.

The scheduler keeps a step's distinct adapters within ``max_loras`` (see
``Scheduler.schedule``), so :meth:`LoRAManager.activate` always finds them a slot, evicting
only adapters the step does not use. An adapter beyond the CPU cache is read again from its
folder when a request needs it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from ladle.runtime.lora.adapter import LoRAAdapter, load_adapter
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.lora.slots import LoRASlots
from ladle.runtime.models.config import ModelConfig

log = logging.getLogger(__name__)


class LoRAManager:
    def __init__(
        self, slots: LoRASlots, config: ModelConfig, max_rank: int, max_cpu_loras: int
    ) -> None:
        self.slots = slots
        self.config = config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._known: dict[int, LoRARequest] = {}
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._resident: OrderedDict[int, int] = OrderedDict()
        self._resident_names: dict[int, str] = {}
        self.num_loads = 0

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter from its folder (any thread: it changes no state)."""
        return load_adapter(request.lora_name, request.lora_path, self.config, self.max_rank)

    def add(self, request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Serve an adapter (read from its folder unless given); False if its id is known."""
        if request.lora_int_id in self._known:
            return False
        adapter = adapter or self.load(request)
        self._known[request.lora_int_id] = request
        self._cache(request.lora_int_id, adapter)
        return True

    def remove(self, lora_id: int) -> bool:
        """Stop serving an adapter. Requests already admitted finish with it: they carry its
        folder, and a slot it holds is freed as the least recently used."""
        if self._known.pop(lora_id, None) is None:
            return False
        self._cpu.pop(lora_id, None)
        return True

    def served(self) -> list[LoRARequest]:
        return list(self._known.values())

    def loaded(self) -> list[str]:
        """Served adapters that sit in a slot, ready for a step without a load."""
        return sorted(name for i, name in self._resident_names.items() if i in self._known)

    def activate(self, requests: list[LoRARequest]) -> dict[int, int]:
        """Slots for a step's adapters (at most ``max_loras`` distinct), loading those that are
        not resident into the least recently used slots that the step does not need."""
        wanted = {r.lora_int_id: r for r in requests}
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"a step uses {len(wanted)} adapters; max_loras is {self.max_loras}")
        for lora_id in wanted:
            if lora_id in self._resident:
                self._resident.move_to_end(lora_id)
        for lora_id, request in wanted.items():
            if lora_id not in self._resident:
                self._resident[lora_id] = self._free_slot(wanted)
                self._resident_names[lora_id] = request.lora_name
                self.slots.write(self._resident[lora_id], self._adapter(request))
                self.num_loads += 1
        return {lora_id: self._resident[lora_id] for lora_id in wanted}

    def _free_slot(self, keep: dict[int, LoRARequest]) -> int:
        used = set(self._resident.values())
        free = [s for s in range(self.max_loras) if s not in used]
        if free:
            return free[0]
        victim = next(i for i in self._resident if i not in keep)
        del self._resident_names[victim]
        return self._resident.pop(victim)

    def _adapter(self, request: LoRARequest) -> LoRAAdapter:
        adapter = self._cpu.get(request.lora_int_id)
        if adapter is None:
            log.info("reading a LoRA adapter again", extra={"lora_name": request.lora_name})
            adapter = self.load(request)
        self._cache(request.lora_int_id, adapter)
        return adapter

    def _cache(self, lora_id: int, adapter: LoRAAdapter) -> None:
        self._cpu[lora_id] = adapter
        self._cpu.move_to_end(lora_id)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
