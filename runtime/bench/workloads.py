"""Synthetic, reproducible request sets for the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass

# A neutral vocabulary: real words tokenize like real prompts, unlike random token ids.
_WORDS = (  # noqa: SIM905 - a word list reads better as prose
    "the of and to in is was for on that with as by at from his her they this which be are "
    "cluster model server request token cache batch memory latency river mountain garden "
    "history science music market window morning evening question answer story system "
    "network engine kernel value number table light paper water stone forest city street "
    "simple quick careful bright quiet ancient modern open small large green blue red "
    "build write read find explain compare describe measure improve travel learn grow"
).split()


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    min_words: int
    max_words: int
    output_len: int

    def prompts(self, seed: int = 0) -> list[str]:
        """The workload's prompts, drawn from a stream of its own: two workloads never share
        prompts (so neither can be served from the other's prefix cache)."""
        rng = random.Random(f"{self.name}/{seed}")
        return [
            " ".join(rng.choice(_WORDS) for _ in range(rng.randint(self.min_words, self.max_words)))
            for _ in range(self.num_requests)
        ]


WORKLOADS = {
    "A": Workload("A", num_requests=32, min_words=8, max_words=200, output_len=128),
    "B": Workload("B", num_requests=128, min_words=8, max_words=200, output_len=64),
}
