"""Turn a batch of logits into next tokens, vectorized over the batch.

Random rows use the exponential-race form of sampling (``argmax(p / q)`` with ``q ~ Exp(1)``),
which equals a categorical draw and lets each seeded row draw its noise from its own generator,
so a seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import torch

from ladle.runtime.sequence import Sequence


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)

    def _generator(self, seq: Sequence) -> torch.Generator:
        gen = self._generators.get(seq.seq_id)
        if gen is None:
            assert seq.params.seed is not None
            gen = torch.Generator(device=self.device).manual_seed(seq.params.seed)
            self._generators[seq.seq_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, seqs: SequenceOf[Sequence]) -> list[int]:
        greedy_tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not random_rows:
            return greedy_tokens.tolist()
        params = [seqs[i].params for i in random_rows]
        rows = torch.tensor(random_rows, device=self.device)
        temperature = torch.tensor([p.temperature for p in params], device=self.device)
        scaled = logits[rows] / temperature[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(top_k) or any(p < 1.0 for p in top_p):
            scaled = self._filter(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(random_rows):
            if seqs[i].params.seed is not None:
                noise[j].exponential_(generator=self._generator(seqs[i]))
        greedy_tokens[rows] = (probs / noise).argmax(dim=-1)
        return greedy_tokens.tolist()

    def _filter(self, logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Mask everything outside each row's top-k and top-p nucleus to -inf."""
        vocab = logits.shape[-1]
        ordered, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor([t if 0 < t < vocab else vocab for t in top_k], device=self.device)
        rank = torch.arange(vocab, device=self.device)[None, :]
        ordered = ordered.masked_fill(rank >= k[:, None], float("-inf"))
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs
        p = torch.tensor(top_p, device=self.device, dtype=probs.dtype)
        ordered = ordered.masked_fill(before > p[:, None], float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, ordered)
