"""Prompt logprobs over the wire: OpenAI's legacy ``echo`` + ``logprobs`` (with ``max_tokens``
0 to score a prompt alone) and vLLM's ``prompt_logprobs`` extension, for text and token-id
prompts. Both carry the same numbers, and those are the model's: transformers, run on the
same tiny model over the same tokens, gives the same log-probabilities."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .conftest import InProcess

TEXT = "The capital of France is Paris, and"


@pytest.fixture(scope="module")
def reference(tiny_model_path: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_model_path: Path) -> list[int]:
    ids: list[int] = AutoTokenizer.from_pretrained(tiny_model_path).encode(TEXT)
    return ids


def complete(server: InProcess, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    choice: dict[str, Any] = response.json()["choices"][0]
    return choice


def by_token_id(prompt_logprobs: list[Any], ids: list[int], key: str) -> list[Any]:
    """vLLM's shape, read at each prompt token (JSON keys are strings); position 0 is null."""
    return [entry[str(t)][key] for entry, t in zip(prompt_logprobs[1:], ids[1:], strict=True)]


@torch.inference_mode()
def transformers_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(token i | tokens before it), for i >= 1."""
    logits = model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.parametrize("as_ids", [False, True], ids=["text", "token_ids"])
def test_echo_scores_the_prompt_like_prompt_logprobs_and_transformers(
    tiny_server: InProcess, reference: Any, prompt_ids: list[int], as_ids: bool
) -> None:
    prompt: str | list[int] = prompt_ids if as_ids else TEXT
    echoed = complete(tiny_server, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    assert echoed["text"] == TEXT  # a token-id prompt is echoed as its decoded text
    lp = echoed["logprobs"]
    n = len(prompt_ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]) == TEXT
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    # The first token has nothing before it: null, as in OpenAI's API.
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    for token, value, top in zip(
        lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True
    ):
        assert top[token] == value
        assert 2 <= len(top) <= 3  # the actual token plus the top 2
    # vLLM's extension on the same choice, keyed by token id.
    extension = echoed["prompt_logprobs"]
    assert extension[0] is None
    assert by_token_id(extension, prompt_ids, "logprob") == lp["token_logprobs"][1:]

    # Without echo: prompt_logprobs alone gives the same numbers.
    plain = complete(tiny_server, prompt=prompt, prompt_logprobs=2, max_tokens=1)
    assert plain["text"] != TEXT
    same = by_token_id(plain["prompt_logprobs"], prompt_ids, "logprob")
    assert same == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)
    assert all(r >= 1 for r in by_token_id(plain["prompt_logprobs"], prompt_ids, "rank"))
    assert same == pytest.approx(transformers_logprobs(reference, prompt_ids), abs=1e-4)


def test_echo_with_generation_appends_the_completion(
    tiny_server: InProcess, prompt_ids: list[int]
) -> None:
    body = {"prompt": TEXT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    plain = complete(tiny_server, **body)
    echoed = complete(tiny_server, **body, echo=True)
    assert echoed["text"] == TEXT + plain["text"]
    n = len(prompt_ids)
    lp, generated = echoed["logprobs"], plain["logprobs"]
    assert lp["tokens"][n:] == generated["tokens"]
    assert lp["token_logprobs"][n:] == generated["token_logprobs"]
    assert lp["top_logprobs"][n:] == generated["top_logprobs"]
    # Offsets run on through the echoed prompt into the completion.
    assert lp["text_offset"][n] == len(TEXT)
    # echo without logprobs: text only.
    bare = complete(tiny_server, prompt=prompt_ids, echo=True, max_tokens=2, temperature=0)
    assert bare["text"].startswith(TEXT)
    assert bare["logprobs"] is None


def test_max_tokens_zero_needs_echo(tiny_server: InProcess) -> None:
    response = httpx.post(
        f"{tiny_server.url}/v1/completions", json={"prompt": TEXT, "max_tokens": 0}, timeout=60
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "max_tokens"
