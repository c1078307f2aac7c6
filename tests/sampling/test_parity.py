"""The must-show checks against transformers on the default model (SmolLM2-135M, fp32):
greedy logprobs equal ``log_softmax`` of its logits, and width-4 beam search picks the same best
sequence as ``generate(num_beams=4, do_sample=False, ...)``.

Beam search settings are mapped one to one: ``beam_width`` -> ``num_beams``, ``max_tokens`` ->
``max_new_tokens``, ``length_penalty`` and ``early_stopping`` as is, EOS = the model's
``eos_token_id`` (2, ``<|im_end|>``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from ladle.runtime.llm import LLM
from ladle.runtime.sampling_params import BeamSearchParams, EarlyStopping, SamplingParams

from .conftest import assert_no_blocks_leaked
from .test_beam_search import transformers_best

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="256MiB", max_model_len=512)


@pytest.fixture(scope="module")
def hf(default_model_path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()


def chat(tokenizer: Any, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_dict=False
    )
    return list(ids)


def test_greedy_logprobs_match_transformers_log_softmax(llm: LLM, hf: Any) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode("The capital of France is"),
        chat(tokenizer, "Name three colors."),
    ]
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    worst = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        completion = out.outputs[0]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.inference_mode():
            reference = hf(ids).logits[0].float().log_softmax(-1)
        # Our greedy tokens are transformers' argmax at every position.
        generated = reference[len(prompt) - 1 : -1]
        assert generated.argmax(-1).tolist() == completion.token_ids
        assert completion.logprobs is not None
        assert out.prompt_logprobs is not None
        positions = [*out.prompt_logprobs[1:], *completion.logprobs]
        for row, position in zip(reference[:-1], positions, strict=True):
            assert position is not None
            for token, lp in position.items():
                worst = max(worst, abs(lp.logprob - float(row[token])))
            # The sampled token plus the top 5, which are transformers' top 5.
            assert set(row.topk(5).indices.tolist()) <= set(position)
        cumulative = float(generated.gather(-1, torch.tensor(completion.token_ids)[:, None]).sum())
        assert completion.cumulative_logprob == pytest.approx(cumulative, abs=1e-3)
    print(f"largest logprob difference: {worst:.2e}")
    assert worst < TOLERANCE
    assert_no_blocks_leaked(llm.engine)


@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(0.5, True)])
def test_beam_search_matches_transformers(
    llm: LLM, hf: Any, length_penalty: float, early_stopping: EarlyStopping
) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [
        chat(tokenizer, "What is 2+2? Reply with the number only."),
        chat(tokenizer, "Is the sky blue? Answer yes or no."),
        tokenizer.encode("The three primary colors are"),
    ]
    params = BeamSearchParams(
        beam_width=4, max_tokens=8, length_penalty=length_penalty, early_stopping=early_stopping
    )
    results = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    ended_by_eos = 0
    for prompt, result in zip(prompts, results, strict=True):
        best = result.sequences[0]
        ours = best.tokens[len(prompt) :]
        assert ours == transformers_best(hf, prompt, params), tokenizer.decode(ours)
        ended_by_eos += best.finish_reason == "stop"
    assert ended_by_eos  # the EOS and early-stopping paths were exercised
    assert_no_blocks_leaked(llm.engine)
