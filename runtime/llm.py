"""The offline API, shaped like vLLM's ``LLM`` class."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence as SequenceOf
from typing import Any, TypeVar

from tqdm import tqdm

from ladle.runtime.beam_search import BeamSearchOutput, BeamSearchSequence
from ladle.runtime.config import EngineArgs
from ladle.runtime.engine import LLMEngine, PromptInput, Request
from ladle.runtime.limits import RequestLimits
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

Message = dict[str, Any]
T = TypeVar("T")


def _as_prompt_list(prompts: PromptInput | SequenceOf[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str | dict):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _per_prompt(
    value: T | SequenceOf[T | None] | None, kind: type[T], count: int, name: str
) -> list[T | None]:
    if value is None or isinstance(value, kind):
        return [value] * count
    items = list(value)  # type: ignore[arg-type]
    if len(items) != count:
        raise ValueError(f"{name} must be one per prompt")
    return items


class LLM:
    """Batch generation over the continuous-batching engine.

    ``LLM()`` serves the embedded default model; keyword arguments are vLLM's engine arguments.
    """

    def __init__(
        self, model: str | None = None, limits: RequestLimits | None = None, **engine_args: Any
    ) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args), limits)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | SequenceOf[PromptInput],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: SequenceOf[int] | None = None,
        lora_request: LoRARequest | SequenceOf[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order. ``lora_request``:
        one adapter for all prompts, or one (or None, the base model) per prompt."""
        items = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params, SamplingParams, len(items), "sampling_params")
        adapters = _per_prompt(lora_request, LoRARequest, len(items), "lora_request")
        final = SamplingParams()
        requests = [
            self.engine.process_inputs(
                str(next(self._ids)),
                prompt,
                dataclasses.replace(p or final, output_kind=RequestOutputKind.FINAL_ONLY),
                priority=priority[i] if priority else 0,
                lora_request=adapters[i],
            )
            for i, (prompt, p) in enumerate(zip(items, params, strict=True))
        ]
        return self._run(requests, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations: list[list[Message]] = (
            [messages] if messages and isinstance(messages[0], dict) else messages  # type: ignore[assignment]
        )
        prompts: list[PromptInput] = []
        for conversation in conversations:
            ids = self.engine.tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **(chat_template_kwargs or {}),
            )
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def beam_search(
        self,
        prompts: PromptInput | SequenceOf[PromptInput],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """vLLM's ``LLM.beam_search``: the best ``beam_width`` sequences per prompt, best first.

        The beams of all prompts run batched in the engine and share KV blocks copy-on-write;
        the search matches transformers' ``generate(num_beams=..., do_sample=False)``.
        """
        requests = [
            self.engine.process_inputs(str(next(self._ids)), prompt, params)
            for prompt in _as_prompt_list(prompts)
        ]
        results = []
        for output in self._run(requests, use_tqdm):
            sequences = [
                BeamSearchSequence(
                    tokens=output.prompt_token_ids + c.token_ids,
                    text=c.text,
                    cum_logprob=c.cumulative_logprob or 0.0,
                    finish_reason=c.finish_reason or "length",
                )
                for c in output.outputs
            ]
            results.append(BeamSearchOutput(sequences))
        return results

    def _run(self, requests: list[Request], use_tqdm: bool) -> list[RequestOutput]:
        """Add requests that were all validated first (so a bad one adds none), then step
        until every one is done. A request that fails inside the engine comes back finished
        with ``error`` set."""
        order = [r.request_id for r in requests]
        try:
            for request in requests:
                self.engine.add_request(request.request_id, request)
        except BaseException:
            self.engine.abort_request(order)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(order), desc="generating", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        done[output.request_id] = output
                        bar.update()
        return [done[rid] for rid in order]
