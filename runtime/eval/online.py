"""Online comparison: two OpenAI-compatible servers, compared over the returned top-k.

For each prompt, each server scores the prompt's own tokens through ``/v1/completions``:

* with vLLM's ``prompt_logprobs: k`` (Ladle and vLLM): per prompt position, a map from token id
  to logprob holding the prompt's actual token (listed first) and the top k;
* or, for servers without it, the legacy ``echo: true`` with ``logprobs: k``: per position the
  actual token's logprob and the top k keyed by token *text*.

Both servers must tokenize the text the same way (the same model, quantized differently);
the actual tokens they report are checked against each other. Greedy agreement compares each
server's ``temperature: 0`` continuation of ``greedy_tokens`` tokens, as text.

Only httpx and the standard library are imported: the operator's canary analysis calls
:func:`evaluate_online` directly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from ladle.runtime.eval.metrics import Accumulator, EvalResult, top1, topk_kld
from ladle.runtime.eval.prompts import Prompt

Protocol = Literal["auto", "prompt_logprobs", "echo"]


class EvalError(RuntimeError):
    """A server could not be evaluated; the message names the server and the reason."""


@dataclass(frozen=True)
class Endpoint:
    """An OpenAI base URL (ending in ``/v1``), the ``model`` to ask for, and a bearer key."""

    base_url: str
    model: str | None = None
    api_key: str | None = None


@dataclass(frozen=True)
class _Scored:
    """One server's view of one prompt: per scored position, the actual token and the
    reported logprobs (the actual token's included)."""

    actual: list[Hashable]
    logprobs: list[dict[Hashable, float]]


class _Client:
    def __init__(self, endpoint: Endpoint, http: httpx.Client, protocol: Protocol) -> None:
        self.endpoint = endpoint
        self.http = http
        self.protocol: Protocol = protocol

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = self.endpoint
        if ep.model is not None:
            body = {"model": ep.model, **body}
        headers = {"Authorization": f"Bearer {ep.api_key}"} if ep.api_key else {}
        url = ep.base_url.rstrip("/") + "/completions"
        try:
            response = self.http.post(url, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise EvalError(f"{url}: {exc}") from None
        if response.status_code != 200:
            raise EvalError(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
        data: dict[str, Any] = response.json()
        return data

    def score(self, text: str, top_k: int) -> _Scored:
        if self.protocol in ("auto", "prompt_logprobs"):
            try:
                return self._score_prompt_logprobs(text, top_k)
            except EvalError:
                if self.protocol == "prompt_logprobs":
                    raise
            self.protocol = "echo"
        return self._score_echo(text, top_k)

    def _score_prompt_logprobs(self, text: str, top_k: int) -> _Scored:
        body = {"prompt": text, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top_k}
        entries = self._post(body)["choices"][0].get("prompt_logprobs")
        if not entries:
            raise EvalError(f"{self.endpoint.base_url}: the response has no prompt_logprobs")
        actual: list[Hashable] = []
        logprobs: list[dict[Hashable, float]] = []
        for entry in entries[1:]:  # the first token has no prediction
            tokens: dict[Hashable, float] = {int(t): float(v["logprob"]) for t, v in entry.items()}
            actual.append(next(iter(tokens)))
            logprobs.append(tokens)
        return _Scored(actual, logprobs)

    def _score_echo(self, text: str, top_k: int) -> _Scored:
        body = {
            "prompt": text,
            "max_tokens": 1,
            "temperature": 0.0,
            "echo": True,
            "logprobs": top_k,
        }
        data = self._post(body)
        lp = data["choices"][0].get("logprobs") or {}
        generated = int((data.get("usage") or {}).get("completion_tokens", 1))
        tokens = lp.get("tokens") or []
        end = len(tokens) - generated
        if end < 2:
            raise EvalError(f"{self.endpoint.base_url}: echo returned no prompt logprobs")
        actual: list[Hashable] = []
        logprobs: list[dict[Hashable, float]] = []
        for i in range(1, end):
            own = lp["token_logprobs"][i]
            entry: dict[Hashable, float] = dict((lp["top_logprobs"][i] or {}).items())
            entry[tokens[i]] = float(own)
            actual.append(tokens[i])
            logprobs.append(entry)
        return _Scored(actual, logprobs)

    def greedy(self, text: str, max_tokens: int) -> str:
        body = {"prompt": text, "max_tokens": max_tokens, "temperature": 0.0}
        return str(self._post(body)["choices"][0]["text"])


def _compare(ref: _Scored, cand: _Scored, where: str, acc: Accumulator) -> None:
    if ref.actual != cand.actual:
        raise EvalError(
            f"{where}: the servers tokenize the prompt differently; compare variants of one model"
        )
    for token, r, c in zip(ref.actual, ref.logprobs, cand.logprobs, strict=True):
        acc.add_position(topk_kld(r, c), top1(r) == top1(c), -r[token], -c[token])


def evaluate_online(
    reference: Endpoint,
    candidate: Endpoint,
    prompts: Sequence[Prompt],
    *,
    top_k: int = 20,
    greedy_tokens: int = 16,
    protocol: Protocol = "auto",
    timeout: float = 120.0,
    concurrency: int = 4,
) -> EvalResult:
    """Compare ``candidate`` with ``reference`` on ``prompts``, teacher-forced, over each
    position's top ``top_k`` (see ``metrics.topk_kld``). Raises :class:`EvalError`."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    with httpx.Client(timeout=timeout) as http:
        ref, cand = _Client(reference, http, protocol), _Client(candidate, http, protocol)

        def one(prompt: Prompt) -> tuple[_Scored, _Scored, bool]:
            scored = (ref.score(prompt.text, top_k), cand.score(prompt.text, top_k))
            same = ref.greedy(prompt.text, greedy_tokens) == cand.greedy(prompt.text, greedy_tokens)
            return (*scored, same)

        # The first prompt settles each server's protocol before the rest run concurrently.
        results = [one(prompts[0])]
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            results += pool.map(one, prompts[1:])
    acc = Accumulator()
    for prompt, (r, c, same) in zip(prompts, results, strict=True):
        _compare(r, c, f"prompt {prompt.id}", acc)
        acc.add_prompt(same)
    return acc.result("online", f"top-{top_k}", greedy_tokens)
