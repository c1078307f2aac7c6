"""Online comparison: two OpenAI-compatible servers, compared over the returned top-k.

For each prompt, each server scores the prompt's own tokens through ``/v1/completions``:

* with vLLM's ``prompt_logprobs: k`` (Ladle and vLLM): per prompt position, a map from token id
  to logprob holding the prompt's actual token (listed first) and the top k;
* or, for servers without it, the legacy ``echo: true`` with ``logprobs: k``: per position the
  actual token's logprob and the top k keyed by token *text*.

Both servers must tokenize the text the same way (the same model, quantized differently);
the actual tokens they report are checked against each other. Greedy agreement compares each
server's ``temperature: 0`` continuation of ``greedy_tokens`` tokens, as text; with
``prompt_logprobs`` that continuation comes from the scoring request itself, so each prompt is
prefilled once per server.

Each server's :class:`Answers` are collected on their own and then compared: the operator's
canary analysis keeps the stable's answers for the next step, which compares a new canary
against the same stable. Only httpx and the standard library are imported, so the operator
calls this module directly.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypedDict, Unpack

import httpx

from ladle.runtime.eval.metrics import Accumulator, EvalResult, top1, topk_kld
from ladle.runtime.eval.prompts import Prompt

Protocol = Literal["auto", "prompt_logprobs", "echo"]


class Settings(TypedDict, total=False):
    """How :func:`collect` asks (its defaults apply to what is left out)."""

    top_k: int
    greedy_tokens: int
    protocol: Protocol
    timeout: float
    concurrency: int


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


@dataclass(frozen=True)
class _Answer:
    scored: _Scored
    greedy: str


@dataclass(frozen=True)
class Answers:
    """One server's answers to a prompt set, under the settings that make them comparable."""

    prompts: tuple[str, ...]
    top_k: int
    greedy_tokens: int
    answers: tuple[_Answer, ...]


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

    def answer(self, text: str, top_k: int, greedy_tokens: int) -> _Answer:
        if self.protocol in ("auto", "prompt_logprobs"):
            try:
                return self._answer_prompt_logprobs(text, top_k, greedy_tokens)
            except EvalError:
                if self.protocol == "prompt_logprobs":
                    raise
            self.protocol = "echo"
        return _Answer(self._score_echo(text, top_k), self.greedy(text, greedy_tokens))

    def _answer_prompt_logprobs(self, text: str, top_k: int, greedy_tokens: int) -> _Answer:
        body = {
            "prompt": text,
            "max_tokens": greedy_tokens,
            "temperature": 0.0,
            "prompt_logprobs": top_k,
        }
        choice = self._post(body)["choices"][0]
        entries = choice.get("prompt_logprobs")
        if not entries:
            raise EvalError(f"{self.endpoint.base_url}: the response has no prompt_logprobs")
        actual: list[Hashable] = []
        logprobs: list[dict[Hashable, float]] = []
        for entry in entries[1:]:  # the first token has no prediction
            tokens: dict[Hashable, float] = {int(t): float(v["logprob"]) for t, v in entry.items()}
            actual.append(next(iter(tokens)))
            logprobs.append(tokens)
        return _Answer(_Scored(actual, logprobs), str(choice["text"]))

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


def collect(
    endpoint: Endpoint,
    prompts: Sequence[Prompt],
    *,
    top_k: int = 20,
    greedy_tokens: int = 16,
    protocol: Protocol = "auto",
    timeout: float = 120.0,
    concurrency: int = 4,
) -> Answers:
    """One server's answers to ``prompts``, ``concurrency`` requests at a time. Raises
    :class:`EvalError`."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if not prompts:
        raise ValueError("no prompts to evaluate")
    with httpx.Client(timeout=timeout) as http:
        client = _Client(endpoint, http, protocol)

        def one(prompt: Prompt) -> _Answer:
            return client.answer(prompt.text, top_k, greedy_tokens)

        # The first prompt settles the server's protocol before the rest run concurrently.
        answers = [one(prompts[0])]
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            answers += pool.map(one, prompts[1:])
    return Answers(tuple(p.text for p in prompts), top_k, greedy_tokens, tuple(answers))


def compare(reference: Answers, candidate: Answers, prompts: Sequence[Prompt]) -> EvalResult:
    """Candidate against reference, over the top-k both reported (see ``metrics.topk_kld``)."""
    texts = tuple(p.text for p in prompts)
    for side in (reference, candidate):
        if side.prompts != texts:
            raise ValueError("answers to other prompts than the ones compared")
    if (reference.top_k, reference.greedy_tokens) != (candidate.top_k, candidate.greedy_tokens):
        raise ValueError("answers collected with different top_k or greedy_tokens")
    acc = Accumulator()
    for prompt, r, c in zip(prompts, reference.answers, candidate.answers, strict=True):
        _compare(r.scored, c.scored, f"prompt {prompt.id}", acc)
        acc.add_prompt(r.greedy == c.greedy)
    return acc.result("online", f"top-{reference.top_k}", reference.greedy_tokens)


def collect_pair(
    reference: Endpoint | Answers,
    candidate: Endpoint,
    prompts: Sequence[Prompt],
    **settings: Unpack[Settings],
) -> tuple[Answers, Answers]:
    """Both servers' answers, collected at once; a reference given as its answers is not asked
    again."""
    if isinstance(reference, Answers):
        return reference, collect(candidate, prompts, **settings)
    with ThreadPoolExecutor(max_workers=1) as pool:
        ref = pool.submit(collect, reference, prompts, **settings)
        cand = collect(candidate, prompts, **settings)
        return ref.result(), cand


def evaluate_online(
    reference: Endpoint,
    candidate: Endpoint,
    prompts: Sequence[Prompt],
    **settings: Unpack[Settings],
) -> EvalResult:
    """Compare ``candidate`` with ``reference`` on ``prompts``, teacher-forced, over each
    position's top ``top_k`` (20). Raises :class:`EvalError`."""
    return compare(*collect_pair(reference, candidate, prompts, **settings), prompts)
