"""`LoRARequest`: which adapter a request runs with (vLLM's fields and meaning).

A leaf module: the scheduler's step output carries it to the runner, the engine validates it,
the server makes one per `--lora-modules` entry and per load request."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """`lora_int_id` (>= 1; 0 is the base model) identifies the adapter everywhere inside the
    engine: the resident slots, the host cache and the prefix cache's block hashes. Two
    requests with the same id must name the same adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 is the base model), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string (a PEFT adapter folder)")
