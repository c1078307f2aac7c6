"""Offline comparison: two engines in one process, full-vocabulary distributions.

Both models score each prompt with their own forward pass and attention backend (an int8 KV
cache included, since prefills read the cache back), over every position at once; greedy
continuations run through each engine's ``generate``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ladle.runtime.eval.metrics import Accumulator, EvalResult
from ladle.runtime.eval.prompts import Prompt
from ladle.runtime.llm import LLM
from ladle.runtime.models.scoring import hidden_states
from ladle.runtime.sampling_params import SamplingParams

# Prompts per forward pass: bounds the scratch KV cache and the logits held at once.
PROMPTS_PER_FORWARD = 4


def _log_probs(llm: LLM, batch: list[list[int]]) -> list[torch.Tensor]:
    model = llm.engine.model
    return [
        torch.log_softmax(model.compute_logits(h).double(), dim=-1)
        for h in hidden_states(model, batch)
    ]


def _add_positions(acc: Accumulator, seq: list[int], ref: torch.Tensor, cand: torch.Tensor) -> None:
    """Score one prompt from both models' log-probabilities [len, vocab]; position i predicts
    token i + 1."""
    ref, cand = ref[:-1], cand[:-1]
    targets = torch.tensor(seq[1:], device=ref.device)[:, None]
    kld = (ref.exp() * (ref - cand)).sum(dim=-1).clamp_min(0.0)
    same = ref.argmax(dim=-1) == cand.argmax(dim=-1)
    nll_ref = -ref.gather(1, targets)[:, 0]
    nll_cand = -cand.gather(1, targets)[:, 0]
    columns = (kld.tolist(), same.tolist(), nll_ref.tolist(), nll_cand.tolist())
    for values in zip(*columns, strict=True):
        acc.add_position(*values)


@torch.inference_mode()
def evaluate_offline(
    reference: LLM,
    candidate: LLM,
    prompts: Sequence[Prompt],
    greedy_tokens: int = 16,
) -> EvalResult:
    """Compare ``candidate`` with ``reference`` on ``prompts`` (see ``metrics``)."""
    tokenizer = reference.get_tokenizer()
    limit = min(reference.engine.max_model_len, candidate.engine.max_model_len) - greedy_tokens
    ids = [list(tokenizer.encode(p.text))[:limit] for p in prompts]
    acc = Accumulator()
    for start in range(0, len(ids), PROMPTS_PER_FORWARD):
        batch = ids[start : start + PROMPTS_PER_FORWARD]
        pairs = zip(_log_probs(reference, batch), _log_probs(candidate, batch), strict=True)
        for seq, (ref, cand) in zip(batch, pairs, strict=True):
            _add_positions(acc, seq, ref, cand)
    params = SamplingParams(temperature=0.0, max_tokens=greedy_tokens)
    inputs = [{"prompt_token_ids": seq} for seq in ids]
    ref_out = reference.generate(inputs, params, use_tqdm=False)
    cand_out = candidate.generate(inputs, params, use_tqdm=False)
    for r, c in zip(ref_out, cand_out, strict=True):
        acc.add_prompt(r.outputs[0].token_ids == c.outputs[0].token_ids)
    return acc.result("offline", "vocabulary", greedy_tokens)
