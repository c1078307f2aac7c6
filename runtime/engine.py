"""The synchronous engine: requests in, one scheduling step at a time, outputs out."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from ladle.runtime.attention import AttentionBackend, KVCacheSpec
from ladle.runtime.attention.registry import select_backend
from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.cuda_graphs import DecodeGraphRunner
from ladle.runtime.errors import RequestError
from ladle.runtime.input_processor import InputProcessor, PromptInput, Request
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.model_runner import ModelRunner
from ladle.runtime.models.config import ModelConfig, model_config_from_hf
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.models.loader import DEFAULT_MODEL_NAME, iter_safetensors, resolve_model
from ladle.runtime.output_processor import OutputProcessor
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams
from ladle.runtime.scheduler import Scheduler

log = logging.getLogger(__name__)

__all__ = ["EngineStats", "IterationStats", "LLMEngine", "PromptInput", "Request"]


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
        if torch.cuda.is_available():
            return torch.device("cuda")
        log.info(
            "no CUDA device: running on the CPU",
            extra={"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")},
        )
        return torch.device("cpu")
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
        kv_dtype = torch.int8 if args.kv_cache_dtype == "int8" else self.dtype
        spec = KVCacheSpec(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, kv_dtype
        )
        backend = select_backend(args.attention_backend, self.device, kv_dtype)
        if kv_dtype == torch.int8 and backend.name != "triton":
            raise ConfigError("kv_cache_dtype int8 needs the triton attention backend")
        self.attention: AttentionBackend = backend(spec, self.device)
        self.model = LlamaModel(cfg, self.attention, self.dtype, self.device)
        self.model.load_weights(iter_safetensors(self.model_path))
        num_blocks = self._num_blocks(spec)
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        caches = self.attention.allocate(num_blocks)
        self.scheduler = Scheduler(
            self.kv,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.scheduling_policy,
            self.max_model_len,
            self.eos_token_ids,
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
        self.input_processor = InputProcessor(
            self.tokenizer,
            cfg.vocab_size,
            self.eos_token_ids,
            self.max_model_len,
            num_blocks,
            args.block_size,
            args.max_num_batched_tokens,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
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
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> Request:
        """Tokenize and validate; safe to call from any thread, it changes no engine state."""
        return self.input_processor.process(request_id, prompt, params, arrival_time, priority)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput | Request,
        params: SamplingParams | BeamSearchParams | None = None,
        priority: int = 0,
    ) -> None:
        if isinstance(prompt, Request):
            request = prompt
        else:
            request = self.process_inputs(
                request_id, prompt, params or SamplingParams(), priority=priority
            )
        if self.output_processor.has_request(request.request_id):
            raise RequestError(f"request id {request.request_id!r} is already in use")
        self.scheduler.add_request(request)
        self.output_processor.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        updates = self.scheduler.finish_requests(ids, "abort")
        return self.output_processor.process(updates).outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_requests > 0

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.num_requests

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
            self.runner.release(out.finished_seq_ids)
            return []
        result = self.runner.execute(out)
        updates = self.scheduler.update_from_output(out, result)
        processed = self.output_processor.process(updates)
        for request_id, indexes in processed.stopped.items():
            self.scheduler.finish_seqs(request_id, indexes)
        stats = IterationStats(
            out.num_batched_tokens, processed.num_prompt_tokens, len(result.sampled)
        )
        for observer in self.iteration_observers:
            observer(stats)
        return processed.outputs
