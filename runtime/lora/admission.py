"""Which waiting requests a schedule may admit for their adapters: a step runs at most
``max_loras`` distinct adapters (the device slots).

A request whose adapter finds no free slot lets those behind it go first (vLLM v1's rule), but
only for ``LORA_MAX_PASSES`` schedules: then requests for other adapters wait behind it (the
base model's still pass), the adapters running drain, and a slot frees for it. So busy
adapters cannot keep a rarely used one out for good.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ladle.runtime.sequence import Sequence

# Schedules a request may be passed over for want of an adapter slot before requests for
# other adapters wait behind it (tens of milliseconds each on a GPU).
LORA_MAX_PASSES = 32


class AdapterAdmission:
    """One schedule's view of the adapter slots, from the adapters the running sequences hold
    (gathered once per schedule: admissions add to it, and an eviction in the same schedule
    leaves its adapter counted until the next one, so a request waits a step longer and a step
    never exceeds ``max_loras``)."""

    def __init__(self, max_loras: int | None, running: Iterable[Sequence]) -> None:
        self.max_loras = max_loras
        self.active: set[int] = set()
        if max_loras is not None:
            self.active = {s.lora.lora_int_id for s in running if s.lora}
        self.starving = False

    def passes_over(self, seq: Sequence) -> bool:
        """Whether ``seq`` waits this schedule for its adapter (counting the passes)."""
        if self.max_loras is None or seq.lora is None:
            return False
        if self.starving:
            return True
        if seq.lora.lora_int_id in self.active or len(self.active) < self.max_loras:
            return False
        seq.lora_passes += 1
        self.starving = seq.lora_passes > LORA_MAX_PASSES
        return True

    def admit(self, seq: Sequence) -> None:
        if seq.lora is not None:
            self.active.add(seq.lora.lora_int_id)
