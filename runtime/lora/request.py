"""A request's adapter, named as vLLM names it so that offline code carries over."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """``lora_int_id`` identifies one load of an adapter: the prefix cache and the resident
    slots are keyed by it, so an adapter loaded again under its name from a new path never
    shares cached KV with its old self. It must be at least 1."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1; got {self.lora_int_id}")
