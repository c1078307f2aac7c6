"""n > 1 and best_of as vLLM v1 runs them: one parent request fanned out into child requests,
which the scheduler sees as ordinary token requests; the output processor gathers them.

Sample i draws from ``seed + i``. The children after the first start once the first has
sampled, so they find its full prompt blocks in the prefix cache and compute only the last,
partial block, where vLLM adds all children at once and each computes the whole prompt."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ladle.runtime.input_processor import Request


@dataclass
class ParentRequest:
    request: Request
    # Children handed to the scheduler so far, in index order.
    started: int = 0

    @property
    def num_children(self) -> int:
        return self.request.params.num_samples

    @property
    def num_unstarted(self) -> int:
        return self.num_children - self.started

    def child_id(self, index: int) -> str:
        """vLLM's child id: the sample's index, then the parent's id."""
        return f"{index}_{self.request.request_id}"

    def child_ids(self) -> list[str]:
        return [self.child_id(i) for i in range(self.num_children)]

    def start(self, count: int) -> list[Request]:
        """The next ``count`` children, for the scheduler; only the first computes the
        prompt's logprobs."""
        first = self.started
        self.started = min(first + count, self.num_children)
        params = self.request.params
        return [
            dataclasses.replace(
                self.request,
                request_id=self.child_id(i),
                params=params if i == 0 else params.clone(prompt_logprobs=None),
                sample_index=i,
            )
            for i in range(first, self.started)
        ]

    def drop_unstarted(self) -> list[str]:
        """Give up the children not yet started (the parent ends); returns their ids."""
        ids = [self.child_id(i) for i in range(self.started, self.num_children)]
        self.started = self.num_children
        return ids
