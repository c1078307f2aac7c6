"""What speculative decoding achieved, counted as vLLM's ``spec_decode`` metrics count it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeCounts:
    """Totals over the engine's life: steps that verified a draft, draft tokens proposed,
    those accepted, and accepted ones by their position in the draft."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        missing = proposed - len(self.accepted_per_position)
        if missing > 0:
            self.accepted_per_position += [0] * missing
        for position in range(accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else None
