"""The synchronous engine: construction, and the step that ties its parts together.

A request goes through the input processor (tokenize, validate, check the limits), the
scheduler (which sequences run, and how many tokens each), the model runner (forward pass and
sampling), the scheduler again (``update_from_output``: the one place scheduling state changes
after a step) and the output processor (detokenization, stop strings, ``RequestOutput``s), as
in vLLM v1.
"""

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
from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.errors import RequestError
from ladle.runtime.forward_pass import ForwardPass
from ladle.runtime.input_processor import InputProcessor, PromptInput, Request
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.limits import RequestLimits
from ladle.runtime.lora.adapter import LoRAAdapter
from ladle.runtime.lora.manager import LoRAManager
from ladle.runtime.lora.request import LoRARequest
from ladle.runtime.lora.slots import LoRASlots
from ladle.runtime.model_runner import ModelRunner, ModelRunnerOutput
from ladle.runtime.models.build import build_model, kv_budget_blocks, resolve_dtype
from ladle.runtime.models.config import ModelConfig, model_config_from_hf
from ladle.runtime.models.loader import DEFAULT_MODEL_NAME, resolve_model
from ladle.runtime.output_processor import OutputProcessor
from ladle.runtime.outputs import RequestOutput
from ladle.runtime.parallel.group import RankFailure, Shard
from ladle.runtime.parallel.layout import check_tensor_parallel, shard_layout
from ladle.runtime.parallel.peers import Peers
from ladle.runtime.sampling_params import BeamSearchParams, SamplingParams
from ladle.runtime.scheduler import Scheduler
from ladle.runtime.scheduler_output import SchedulerOutput
from ladle.runtime.sequence import Sequence
from ladle.runtime.spec_decode.counts import SpecDecodeCounts
from ladle.runtime.spec_decode.draft_model import DraftModel, build_draft

log = logging.getLogger(__name__)

__all__ = ["EngineStats", "IterationStats", "LLMEngine", "PromptInput", "Request"]

# A model step that fails for every sequence this many times in a row means the device, not a
# request, is broken: the engine raises and its loop dies.
_MAX_FAILED_STEPS = 3


@dataclass
class EngineStats:
    """Counters and gauges that the server exports as Prometheus metrics."""

    num_running: int
    num_waiting: int
    # Waiting sequences, counting the samples of n>1 requests yet to start and the beams waiting
    # searches will fork.
    num_waiting_seqs: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_blocks: int
    num_free_blocks: int
    # Adapters by name: of running requests, of waiting ones, and those in device slots.
    running_loras: list[str]
    waiting_loras: list[str]
    loaded_loras: list[str]
    # Speculative decoding's totals (all zero without it).
    spec_decode: SpecDecodeCounts


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
        # The devices a container was given: NVIDIA's device plugin names them in
        # NVIDIA_VISIBLE_DEVICES, a user may narrow them with CUDA_VISIBLE_DEVICES.
        log.info(
            "no CUDA device: running on the CPU",
            extra={
                "nvidia_visible_devices": os.environ.get("NVIDIA_VISIBLE_DEVICES"),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            },
        )
        return torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda was requested but no CUDA device is available")
    return device


class LLMEngine:
    def __init__(self, args: EngineArgs, limits: RequestLimits | None = None) -> None:
        self.args = args
        self.limits = limits or RequestLimits()
        self.device = _resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.device)
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
        size = args.tensor_parallel_size
        check_tensor_parallel(cfg, size)
        # The other ranks, started first so that they load their slices while this one does.
        self.peers = Peers.start(args, size, self.device) if size > 1 else None
        try:
            shard = (
                None if self.peers is None else Shard(shard_layout(cfg, size, 0), self.peers.group)
            )
            self.model, spec = build_model(
                args, cfg, self.model_path, self.device, self.dtype, shard
            )
            self.attention: AttentionBackend = self.model.attention
            self.lora: LoRAManager | None = None
            if args.enable_lora:
                slots = LoRASlots(cfg, args.max_loras, args.max_lora_rank, self.dtype, self.device)
                self.model.enable_lora(slots)
                cpu = args.max_cpu_loras or args.max_loras
                self.lora = LoRAManager(slots, cfg, args.max_lora_rank, cpu)
            speculative = args.speculative()
            draft = None
            if speculative is not None and speculative.method == "draft_model":
                draft = build_draft(
                    args, speculative, cfg, self.model_path, self.device, self.dtype
                )
            num_blocks = self._num_blocks(spec, None if draft is None else draft[1])
        except BaseException:
            self.shutdown()
            raise
        self.kv = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching)
        caches = self.attention.allocate(num_blocks)
        self.scheduler = Scheduler(
            self.kv,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.scheduling_policy,
            self.max_model_len,
            self.eos_token_ids,
            args.max_loras if args.enable_lora else None,
            speculative,
        )
        forward = ForwardPass(self.model, caches, self.device)
        self.runner = ModelRunner(forward, self.kv)
        self.runner.lora = self.lora
        self.runner.peers = self.peers
        # The fast decode paths run the whole model in one call, without the collectives.
        fast = not args.enforce_eager and self.peers is None
        if fast:
            forward.enable_fast_paths(args.max_num_seqs, self.max_model_len, args.block_size)
        if draft is not None:
            drafter = ForwardPass(draft[0], draft[0].attention.allocate(num_blocks), self.device)
            if fast:
                drafter.enable_fast_paths(args.max_num_seqs, self.max_model_len, args.block_size)
            self.runner.drafter = DraftModel(drafter, args.block_size)
        self.input_processor = InputProcessor(
            self.tokenizer,
            cfg.vocab_size,
            self.eos_token_ids,
            self.max_model_len,
            num_blocks,
            args.block_size,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.scheduling_policy,
            self.limits,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        # Called on the engine's thread after every step that ran the model.
        self.iteration_observers: list[Callable[[IterationStats], None]] = []
        self.last_progress = time.monotonic()
        self._failed_steps = 0
        log.info(
            "engine ready",
            extra={
                "model": str(self.model_path),
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "attention_backend": self.attention.name,
                "quantization": args.quantization_config().describe(),
                "kv_cache_dtype": str(spec.dtype).removeprefix("torch."),
                "tensor_parallel_size": size,
                "speculative": None if speculative is None else speculative.method,
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

    def _num_blocks(self, spec: KVCacheSpec, draft: KVCacheSpec | None) -> int:
        """Blocks for the KV budget. One sequence of max_model_len tokens must fit (vLLM's
        rule), or a long request could preempt itself for ever: an explicit max_model_len that
        does not fit is an error; the model's own is lowered to what fits."""
        num_blocks = kv_budget_blocks(self.args, self.model, spec, draft)
        if self.peers is not None:
            num_blocks = self.peers.agree_blocks(num_blocks)
        if num_blocks < 1:
            raise ConfigError("no memory is left for the KV cache; raise the memory budget")
        capacity = num_blocks * self.args.block_size
        if capacity < self.max_model_len:
            if self.args.max_model_len is not None:
                raise ConfigError(
                    f"max_model_len {self.max_model_len} does not fit in the KV cache, which "
                    f"holds {capacity} tokens; raise the KV cache memory or lower max_model_len"
                )
            log.warning(
                "max_model_len lowered to what the KV cache holds",
                extra={"max_model_len": capacity, "model_max": self.max_model_len},
            )
            self.max_model_len = capacity
        return num_blocks

    # -- requests ---------------------------------------------------------------------------

    def process_inputs(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        priority: int = 0,
        deadline: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Request:
        """Tokenize and validate; safe to call from any thread, it changes no engine state."""
        if lora_request is not None and self.lora is None:
            raise RequestError(
                f"the LoRA adapter {lora_request.lora_name!r} cannot be served: LoRA is off; "
                "start the engine with --enable-lora",
                "model",
            )
        request = self.input_processor.process(
            request_id, prompt, params, arrival_time, priority, deadline
        )
        request.lora_request = lora_request
        return request

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput | Request,
        params: SamplingParams | BeamSearchParams | None = None,
        priority: int = 0,
        deadline: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Admit a request; ``deadline`` (``time.monotonic()``) ends it with finish reason
        "abort" if it is not done by then. An adapter not yet served is read from its folder
        first, as vLLM does."""
        if isinstance(prompt, Request):
            request = prompt
        else:
            request = self.process_inputs(
                request_id,
                prompt,
                params or SamplingParams(),
                priority=priority,
                deadline=deadline,
                lora_request=lora_request,
            )
        if request.lora_request is not None and self.lora is not None:
            self.lora.add(request.lora_request)
        if not self.has_unfinished_requests():
            self.last_progress = time.monotonic()
        for scheduled in self.output_processor.add_request(request):
            self.scheduler.add_request(scheduled)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Stop requests now and free their blocks; returns their final outputs."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return self._end(ids, "abort")

    def _end(self, ids: list[str], reason: str, error: str | None = None) -> list[RequestOutput]:
        scheduled, unstarted = self.output_processor.end(ids, reason)
        updates = self.scheduler.finish_requests(scheduled, reason, error)
        return self.output_processor.process(updates + unstarted).outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_requests > 0

    @property
    def num_unfinished_requests(self) -> int:
        return self.output_processor.num_requests

    def has_request(self, request_id: str) -> bool:
        return self.output_processor.has_request(request_id)

    def seconds_without_progress(self) -> float:
        """How long unfinished work has waited for a token to be computed or sampled (0 when
        there is no work): what the liveness probe's watchdog reads, from any thread."""
        if not self.has_unfinished_requests():
            return 0.0
        return time.monotonic() - self.last_progress

    # -- adapters (vLLM's add_lora, remove_lora, list_loras) --------------------------------

    def add_lora(self, lora_request: LoRARequest, adapter: LoRAAdapter | None = None) -> bool:
        """Serve an adapter; ``adapter``: its weights, already read (``LoRAManager.load``
        off the engine's thread). False if its id is served already."""
        return self._lora_manager().add(lora_request, adapter)

    def remove_lora(self, lora_id: int) -> bool:
        return self._lora_manager().remove(lora_id)

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self._lora_manager().served()}

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise RequestError("LoRA is off; start the engine with --enable-lora")
        return self.lora

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (vLLM's ``reset_prefix_cache``), e.g. between benchmark
        runs, so that no run is served from another's cache."""
        self.kv.pool.reset_prefix_cache()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running) + len(self.scheduler.parked),
            num_waiting=len(self.scheduler.waiting),
            num_waiting_seqs=self.scheduler.num_waiting_seqs + self.output_processor.num_unstarted,
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_blocks=self.kv.pool.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            running_loras=_adapter_names((*self.scheduler.running, *self.scheduler.parked)),
            waiting_loras=_adapter_names(self.scheduler.waiting),
            loaded_loras=[] if self.lora is None else self.lora.loaded(),
            spec_decode=self.scheduler.drafting.counts,
        )

    def check_health(self) -> None:
        """Raise if the engine cannot step any more (a tensor-parallel rank has exited)."""
        if self.peers is not None:
            self.peers.check()

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks; the engine cannot step afterwards."""
        if self.peers is not None:
            self.peers.close()
            self.peers = None

    # -- stepping ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and report every request that changed.

        A failure that belongs to one request ends that request alone, with an error in its
        output, and the engine goes on; only a model runner that fails every sequence, step
        after step, is taken to be broken and raises."""
        outputs = self._end(self.scheduler.expire(time.monotonic()), "abort")
        out = self.scheduler.schedule()
        if out.is_empty:
            self.runner.release(out.finished_seq_ids)
            return outputs
        progress = self.scheduler.progress
        result, failed = self._execute(out)
        if failed:
            out.scheduled = [i for i in out.scheduled if i.seq.request_id not in failed]
        updates = self.scheduler.update_from_output(out, result)
        for request_id, message in failed.items():
            updates += self.scheduler.finish_requests([request_id], "error", message)
        processed = self.output_processor.process(updates)
        for request_id in processed.stopped:
            self.scheduler.finish_stopped(request_id)
        for request_id, message in processed.failed.items():
            self.scheduler.finish_requests([request_id], "error", message)
        for request in processed.started:
            self.scheduler.add_request(request)
        if self.scheduler.progress > progress or processed.num_finished:
            self.last_progress = time.monotonic()
        stats = IterationStats(
            out.num_batched_tokens, processed.num_prompt_tokens, len(result.sampled)
        )
        for observer in self.iteration_observers:
            observer(stats)
        return outputs + processed.outputs

    def _execute(self, out: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """Run the step; if it fails, run each sequence alone, so that only the requests that
        fail by themselves fail (rewriting a sequence's KV slots is harmless)."""
        try:
            result = self.runner.execute(out)
        except Exception as exc:
            if self.peers is not None:
                # The other ranks may be inside this step's collectives: no step can follow.
                raise RankFailure(f"a tensor-parallel step failed: {exc!r}") from exc
            log.exception("a step failed; retrying its sequences one by one")
        else:
            self._failed_steps = 0
            return result, {}
        result = ModelRunnerOutput()
        failed: dict[str, str] = {}
        for item in out.scheduled:
            single = SchedulerOutput([item], out.block_copies)
            try:
                part = self.runner.execute(single)
            except Exception as exc:
                log.exception(
                    "a sequence failed on its own", extra={"request_id": item.seq.request_id}
                )
                failed[item.seq.request_id] = f"internal error in the model step: {exc!r}"
                continue
            result.sampled.update(part.sampled)
            result.prompt_logprobs.update(part.prompt_logprobs)
        everything = {i.seq.request_id for i in out.scheduled}
        self._failed_steps = self._failed_steps + 1 if failed.keys() == everything else 0
        if self._failed_steps >= _MAX_FAILED_STEPS:
            raise RuntimeError(
                f"the model step failed for every sequence {self._failed_steps} times in a row"
            )
        return result, failed


def _adapter_names(seqs: Iterable[Sequence]) -> list[str]:
    return sorted({seq.lora.lora_name for seq in seqs if seq.lora is not None})
