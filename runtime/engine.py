"""The synchronous engine: requests in, one scheduling step at a time, outputs out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ladle.runtime.attention import AttentionBackend, KVCacheSpec
from ladle.runtime.attention.registry import select_backend
from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.cuda_graphs import DecodeGraphRunner
from ladle.runtime.detokenizer import IncrementalDetokenizer
from ladle.runtime.errors import RequestError
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.model_runner import ModelRunner
from ladle.runtime.models.config import ModelConfig, model_config_from_hf
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.models.loader import DEFAULT_MODEL_NAME, iter_safetensors, resolve_model
from ladle.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ladle.runtime.sampling_params import RequestOutputKind, SamplingParams
from ladle.runtime.scheduler import Scheduler
from ladle.runtime.sequence import Sequence

log = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]


@dataclass
class Request:
    """A validated, tokenized request, ready for the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0


@dataclass
class _RequestState:
    request: Request
    seqs: list[Sequence]
    detokenizers: list[IncrementalDetokenizer]
    metrics: RequestMetrics
    sent_tokens: list[int] = field(default_factory=list)
    sent_chars: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class EngineStats:
    """Counters and gauges that the server exports as Prometheus metrics."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int


@dataclass
class IterationStats:
    """What one step did, for per-iteration metrics; handed to ``LLMEngine.iteration_observers``.

    Prompt tokens are counted once per request, when its first token is sampled (vLLM's rule),
    so recomputation after preemption is not counted twice.
    """

    num_batched_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was requested but no CUDA device is available")
    return device


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype: torch.dtype = getattr(torch, name)
    return dtype


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.device = _resolve_device(args.device)
        self.dtype = _resolve_dtype(args.dtype, self.device)
        torch.manual_seed(args.seed)
        started = time.monotonic()
        self.model_path = resolve_model(args.model)
        self.served_model_name = args.served_model_name or (
            DEFAULT_MODEL_NAME if args.model is None else self.model_path.name
        )
        hf_config = AutoConfig.from_pretrained(self.model_path)
        self.model_config: ModelConfig = model_config_from_hf(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.max_model_len = self._max_model_len(args)
        self.eos_token_ids = self._eos_token_ids(hf_config)

        cfg = self.model_config
        spec = KVCacheSpec(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, self.dtype
        )
        self.attention: AttentionBackend = select_backend(args.attention_backend, self.device)(
            spec, self.device
        )
        self.model = LlamaModel(cfg, self.attention, self.dtype, self.device)
        self.model.load_weights(iter_safetensors(self.model_path))
        num_blocks = self._num_blocks(spec)
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        caches = self.attention.allocate(num_blocks)
        self.scheduler = Scheduler(
            self.kv, args.max_num_seqs, args.max_num_batched_tokens, args.scheduling_policy
        )
        self.runner = ModelRunner(self.model, self.attention, caches, self.kv, self.device)
        graphs = self.attention.name == "triton" and not args.enforce_eager
        if self.device.type == "cuda" and graphs:
            self.runner.graphs = DecodeGraphRunner(
                self.model,
                caches,
                args.max_num_seqs,
                self.max_model_len,
                args.block_size,
                self.device,
                use_graphs=True,
            )
            self.runner.graphs.capture()
        self._requests: dict[str, _RequestState] = {}
        self._seq_owner: dict[int, _RequestState] = {}
        # Called on the engine's thread after every step that ran the model.
        self.iteration_observers: list[Callable[[IterationStats], None]] = []
        log.info(
            "engine ready",
            extra={
                "model": str(self.model_path),
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "attention_backend": self.attention.name,
                "num_kv_blocks": num_blocks,
                "max_model_len": self.max_model_len,
                "load_seconds": round(time.monotonic() - started, 2),
            },
        )

    def _max_model_len(self, args: EngineArgs) -> int:
        limit = self.model_config.max_position_embeddings
        if self.model_config.sliding_window:
            # Attention here is full; cap the context where the model's window would start.
            limit = min(limit, self.model_config.sliding_window)
        if args.max_model_len is None:
            return limit
        if args.max_model_len > limit:
            raise ConfigError(f"max_model_len {args.max_model_len} exceeds the model's {limit}")
        return args.max_model_len

    def _eos_token_ids(self, hf_config: Any) -> set[int]:
        ids: set[int] = set()
        try:
            gen = GenerationConfig.from_pretrained(self.model_path)
            candidates: Any = gen.eos_token_id
        except OSError:
            candidates = getattr(hf_config, "eos_token_id", None)
        if isinstance(candidates, int):
            ids.add(candidates)
        elif candidates:
            ids.update(candidates)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _num_blocks(self, spec: KVCacheSpec) -> int:
        args = self.args
        if args.num_gpu_blocks_override is not None:
            return args.num_gpu_blocks_override
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            cfg = self.model_config
            width = 4 * cfg.hidden_size + 2 * cfg.intermediate_size + cfg.q_size
            activations = 4 * args.max_num_batched_tokens * width * 4
            logits = args.max_num_seqs * cfg.vocab_size * 4 * 4
            budget = int(total * args.gpu_memory_utilization) - (total - free)
            budget -= activations + logits
        else:
            budget = args.kv_cache_memory
        num_blocks = budget // spec.bytes_per_block
        min_blocks = -(-self.max_model_len // args.block_size)
        if num_blocks < 1:
            raise ConfigError("no memory is left for the KV cache; raise the memory budget")
        if num_blocks < min_blocks:
            log.warning(
                "KV cache holds fewer tokens than max_model_len",
                extra={"kv_tokens": num_blocks * args.block_size},
            )
        return int(num_blocks)

    # -- requests ---------------------------------------------------------------------------

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Tokenize and validate; safe to call from any thread, it changes no engine state."""
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, list(self.tokenizer.encode(prompt))
        elif isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text, ids = prompt["prompt"], list(self.tokenizer.encode(prompt["prompt"]))
            else:
                raise RequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})", "prompt")
        if len(ids) > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, "
                f"but the prompt has {len(ids)} tokens",
                "prompt",
            )
        needed = self.kv.blocks_needed(len(ids) + 1)
        if needed > self.kv.pool.num_blocks:
            raise RequestError(
                f"the prompt needs {needed} KV blocks but the cache has "
                f"{self.kv.pool.num_blocks}; raise the KV cache memory",
                "prompt",
            )
        return Request(
            request_id,
            text,
            ids,
            params,
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
        )

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput | Request,
        params: SamplingParams | None = None,
        priority: int = 0,
    ) -> None:
        if isinstance(prompt, Request):
            request = prompt
        else:
            request = self.process_inputs(
                request_id, prompt, params or SamplingParams(), priority=priority
            )
        if request.request_id in self._requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        seq = Sequence(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.arrival_time,
            request.priority,
        )
        state = _RequestState(
            request,
            [seq],
            [self._detokenizer(request)],
            RequestMetrics(arrival_time=request.arrival_time),
            sent_tokens=[0],
            sent_chars=[0],
        )
        self._requests[request.request_id] = state
        self._seq_owner[seq.seq_id] = state
        self.scheduler.add(seq)

    def _detokenizer(self, request: Request) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.params.skip_special_tokens
        )

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = []
        for rid in ids:
            state = self._requests.get(rid)
            if state is None:
                continue
            live = [s for s in state.seqs if not s.is_finished]
            for seq in live:
                seq.finish_reason = "abort"
            self._finish(state, live)
            output = self._output(state)
            if output is not None:
                outputs.append(output)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_blocks=self.kv.pool.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
        )

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that changed."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        now = time.monotonic()
        for item in out.scheduled:
            metrics = self._seq_owner[item.seq.seq_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        sampled = self.runner.execute(out)
        self.scheduler.on_step_done(out)
        now = time.monotonic()
        changed: dict[str, _RequestState] = {}
        finished: dict[str, list[Sequence]] = {}
        stats = IterationStats(out.num_batched_tokens, 0, 0)
        for item in out.scheduled:
            seq = item.seq
            token = sampled.get(seq.seq_id)
            if token is None:
                continue
            seq.append_token(token)
            self._check_stop(seq, token)
            state = self._seq_owner[seq.seq_id]
            rid = state.request.request_id
            if seq.finish_reason is not None:
                finished.setdefault(rid, []).append(seq)
            stats.num_generation_tokens += 1
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                stats.num_prompt_tokens += len(state.request.prompt_token_ids)
            state.metrics.last_token_time = now
            changed[rid] = state
        for rid, seqs in finished.items():
            self._finish(changed[rid], seqs)
        for observer in self.iteration_observers:
            observer(stats)
        return [o for o in (self._output(s) for s in changed.values()) if o is not None]

    def _check_stop(self, seq: Sequence, token: int) -> None:
        params = seq.params
        if token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif not params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif (
            params.max_tokens is not None and len(seq.output_token_ids) >= params.max_tokens
        ) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _finish(self, state: _RequestState, seqs: list[Sequence]) -> None:
        self.scheduler.finish(seqs)
        for seq in seqs:
            self.runner.sampler.forget(seq)
        if state.finished:
            state.metrics.finished_time = time.monotonic()
            del self._requests[state.request.request_id]
            for seq in state.seqs:
                self._seq_owner.pop(seq.seq_id, None)

    def _output(self, state: _RequestState) -> RequestOutput | None:
        kind = state.request.params.output_kind
        done = state.finished
        if kind is RequestOutputKind.FINAL_ONLY and not done:
            return None
        completions = []
        for i, (seq, detok) in enumerate(zip(state.seqs, state.detokenizers, strict=True)):
            detok.step(seq.output_token_ids[detok.num_ids :])
            if kind is RequestOutputKind.DELTA:
                tokens = seq.output_token_ids[state.sent_tokens[i] :]
                text = detok.text[state.sent_chars[i] :]
                state.sent_tokens[i] = len(seq.output_token_ids)
                state.sent_chars[i] = len(detok.text)
            else:
                tokens, text = list(seq.output_token_ids), detok.text
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=text,
                    token_ids=tokens,
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                )
            )
        return RequestOutput(
            request_id=state.request.request_id,
            prompt=state.request.prompt,
            prompt_token_ids=state.request.prompt_token_ids,
            outputs=completions,
            finished=done,
            metrics=state.metrics,
            num_cached_tokens=state.seqs[0].num_cached_tokens,
        )
