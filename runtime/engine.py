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
from ladle.runtime.beam_search import BeamCandidates, BeamSearch
from ladle.runtime.config import ConfigError, EngineArgs
from ladle.runtime.cuda_graphs import DecodeGraphRunner
from ladle.runtime.detokenizer import IncrementalDetokenizer
from ladle.runtime.errors import RequestError
from ladle.runtime.kv_cache.manager import KVCacheManager
from ladle.runtime.model_runner import ModelRunner
from ladle.runtime.models.config import ModelConfig, model_config_from_hf
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.models.loader import DEFAULT_MODEL_NAME, iter_safetensors, resolve_model
from ladle.runtime.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from ladle.runtime.quantization.apply import quantize_at_load
from ladle.runtime.sampler import TokenLogprobs
from ladle.runtime.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from ladle.runtime.scheduler import Scheduler
from ladle.runtime.sequence import Sequence

log = logging.getLogger(__name__)

PromptInput = str | list[int] | dict[str, Any]
# vLLM's default --max-logprobs.
MAX_LOGPROBS = 20


@dataclass
class Request:
    """A validated, tokenized request, ready for the scheduler."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    # Set for beam search; ``params`` then describes how each beam is stepped.
    beam_params: BeamSearchParams | None = None


@dataclass
class _SeqOutput:
    """What one sequence has produced for its caller, and how much of it was already sent."""

    detokenizer: IncrementalDetokenizer
    logprobs: SampleLogprobs | None
    sent_tokens: int = 0
    sent_chars: int = 0
    sent_finish: bool = False


@dataclass
class _RequestState:
    request: Request
    # Sampling: the sequences by index (n or best_of of them once forked); beam search: the
    # live beams.
    seqs: list[Sequence]
    outs: list[_SeqOutput]
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None
    prompt_logprobs_sent: bool = False
    beam: BeamSearch | None = None
    # Beam search: this step's sample of each live beam, by seq_id.
    pending: dict[int, TokenLogprobs] = field(default_factory=dict)

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
        kv_dtype = torch.int8 if args.kv_cache_dtype == "int8" else self.dtype
        spec = KVCacheSpec(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, kv_dtype
        )
        backend = select_backend(args.attention_backend, self.device, kv_dtype, self.dtype)
        self.attention: AttentionBackend = backend(spec, self.device)
        self.model = LlamaModel(cfg, self.attention, self.dtype, self.device)
        self.model.load_weights(iter_safetensors(self.model_path))
        quantization = args.quantization_config()
        quantize_at_load(self.model, quantization, self.model_path)
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
        self._token_text: dict[int, str] = {}
        # Called on the engine's thread after every step that ran the model.
        self.iteration_observers: list[Callable[[IterationStats], None]] = []
        log.info(
            "engine ready",
            extra={
                "model": str(self.model_path),
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "attention_backend": self.attention.name,
                "quantization": quantization.describe(),
                "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
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
        beam_params = params if isinstance(params, BeamSearchParams) else None
        return Request(
            request_id,
            text,
            ids,
            self._bind_params(params),
            time.monotonic() if arrival_time is None else arrival_time,
            priority,
            beam_params,
        )

    def _bind_params(self, params: SamplingParams | BeamSearchParams) -> SamplingParams:
        """Check the request's token ids against the model and add the tokenizer's data. A beam
        search steps each beam greedily, reporting the top logprobs the search ranks."""
        if isinstance(params, BeamSearchParams):
            # All beams must fit in one step, or the last ones would never run with the others.
            if params.beam_width > self.args.max_num_batched_tokens:
                raise RequestError(
                    f"beam_width: must be <= max_num_batched_tokens "
                    f"({self.args.max_num_batched_tokens}), got {params.beam_width}",
                    "beam_width",
                )
            eos = frozenset(self.eos_token_ids)
            width = BeamSearch(params, eos, params.max_tokens).num_candidates
            params = SamplingParams(
                temperature=0.0, max_tokens=None, ignore_eos=True, logprobs=width
            )
            return params.bind(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > MAX_LOGPROBS:
                raise RequestError(f"{name}: must be <= {MAX_LOGPROBS}, got {value}", name)
        return params.bind(self.tokenizer, self.eos_token_ids, self.model_config.vocab_size)

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
        if request.request_id in self._requests:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        seq = Sequence(
            request.request_id,
            request.prompt_token_ids,
            request.params,
            request.arrival_time,
            request.priority,
        )
        state = _RequestState(request, [seq], [], RequestMetrics(request.arrival_time))
        if request.beam_params is not None:
            bp = request.beam_params
            limit = min(bp.max_tokens, self.max_model_len - len(request.prompt_token_ids))
            eos = frozenset(self.eos_token_ids)
            state.beam = BeamSearch(bp, eos, max(limit, 1))
        else:
            state.outs.append(self._seq_output(request, request.params))
            if request.params.prompt_logprobs is not None:
                state.prompt_logprobs = [None] * len(request.prompt_token_ids)
        self._requests[request.request_id] = state
        self._seq_owner[seq.seq_id] = state
        self.scheduler.add(seq)

    def _seq_output(self, request: Request, params: SamplingParams) -> _SeqOutput:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
        return _SeqOutput(detokenizer, [] if params.logprobs is not None else None)

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
                if state.outs:
                    state.outs[seq.index].detokenizer.update([], final=True, check_stop=False)
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
        result = self.runner.execute(out)
        self.scheduler.on_step_done(out)
        now = time.monotonic()
        changed: dict[str, _RequestState] = {}
        finished: dict[str, list[Sequence]] = {}
        stats = IterationStats(out.num_batched_tokens, 0, 0)
        for seq_id, (first, lps) in result.prompt_logprobs.items():
            self._record_prompt_logprobs(self._seq_owner[seq_id], first, lps)
        for item in out.scheduled:
            seq = item.seq
            sample = result.sampled.get(seq.seq_id)
            if sample is None:
                continue
            state = self._seq_owner[seq.seq_id]
            rid = state.request.request_id
            stats.num_generation_tokens += 1
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                stats.num_prompt_tokens += len(state.request.prompt_token_ids)
            state.metrics.last_token_time = now
            changed[rid] = state
            if state.beam is not None:
                state.pending[seq.seq_id] = sample
                self.scheduler.detach(seq)
                continue
            self._append(state, seq, sample)
            if seq.finish_reason is not None:
                finished.setdefault(rid, []).append(seq)
        for rid, seqs in finished.items():
            self._finish(changed[rid], seqs)
        for state in changed.values():
            if state.beam is not None:
                self._advance_beams(state)
        for observer in self.iteration_observers:
            observer(stats)
        return [o for o in (self._output(s) for s in changed.values()) if o is not None]

    def _append(self, state: _RequestState, seq: Sequence, sample: TokenLogprobs) -> None:
        """Take a sampled token: logprobs, n>1 fork, stop checks, incremental text."""
        params = seq.params
        token = sample.token_id
        seq.append_token(token)
        seq.cumulative_logprob += sample.logprob
        out = state.outs[seq.index]
        if out.logprobs is not None:
            out.logprobs.append(self._logprob_dict(sample))
        if len(state.seqs) < params.num_samples:
            self._fork_samples(state, seq)
        self._check_stop(seq, token)
        by_token = seq.finish_reason == "stop"
        stop = out.detokenizer.update(
            [] if by_token and not params.include_stop_str_in_output else [token],
            final=seq.finish_reason is not None,
            check_stop=not by_token and len(seq.output_token_ids) >= params.min_tokens,
        )
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop

    def _fork_samples(self, state: _RequestState, parent: Sequence) -> None:
        """n>1 / best_of: once the prompt is prefilled, fork the other samples off the first.

        Children share every prompt block copy-on-write and recompute only the last prompt
        token, to draw their own first token (seeded children use ``seed + index``, as vLLM)."""
        params = parent.params
        for index in range(1, params.num_samples):
            child_params = params if params.seed is None else params.clone(seed=params.seed + index)
            child = Sequence(
                parent.request_id,
                parent.prompt_token_ids,
                child_params,
                parent.arrival_time,
                parent.priority,
                index=index,
            )
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_prompt_tokens - 1
            child.num_cached_tokens = parent.num_cached_tokens
            state.seqs.append(child)
            state.outs.append(self._seq_output(state.request, child_params))
            self._seq_owner[child.seq_id] = state
            self.scheduler.add_running(child)

    def _advance_beams(self, state: _RequestState) -> None:
        """One beam-search step once every live beam has sampled; the chosen continuations
        fork their parents' blocks and dropped beams free theirs at once.

        Beams that sampled are held out of scheduling (keeping their blocks) until the others
        have too, so that siblings that missed a step (out of token budget, or preempted)
        catch up without competing with them."""
        assert state.beam is not None
        beams = [s for s in state.seqs if not s.is_finished]
        if any(b.seq_id not in state.pending for b in beams):
            return
        samples = [state.pending.pop(b.seq_id) for b in beams]
        continuations = state.beam.step(
            [
                BeamCandidates(
                    b.output_token_ids, b.cumulative_logprob, s.top_token_ids, s.top_logprobs
                )
                for b, s in zip(beams, samples, strict=True)
            ]
        )
        if state.beam.done:
            for b in beams:
                b.finish_reason = "length"
            self._finish(state, beams)
            return
        survivors: list[Sequence] = []
        reused: set[int] = set()
        for c in continuations:
            parent = beams[c.parent]
            if c.parent not in reused:
                reused.add(c.parent)
                survivors.append(parent)
                continue
            child = Sequence(
                parent.request_id,
                parent.prompt_token_ids,
                parent.params,
                parent.arrival_time,
                parent.priority,
            )
            child.token_ids = list(parent.token_ids)
            child.output_token_ids = list(parent.output_token_ids)
            child.num_cached_tokens = parent.num_cached_tokens
            self.kv.fork(parent, child)
            self._seq_owner[child.seq_id] = state
            survivors.append(child)
        for seq, c in zip(survivors, continuations, strict=True):
            seq.append_token(c.token_id)
            seq.cumulative_logprob = c.cumulative_logprob
            self.scheduler.add_running(seq)
        dropped = [b for i, b in enumerate(beams) if i not in reused]
        self.scheduler.finish(dropped)
        for b in dropped:
            self._seq_owner.pop(b.seq_id, None)
        state.seqs = survivors

    def _record_prompt_logprobs(
        self, state: _RequestState, first: int, lps: list[TokenLogprobs]
    ) -> None:
        assert state.prompt_logprobs is not None
        for offset, lp in enumerate(lps):
            state.prompt_logprobs[first + offset] = self._logprob_dict(lp)

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """vLLM's per-position shape: the chosen token first, then the top-N by rank."""
        ids = [lp.token_id, *lp.top_token_ids]
        texts = self._decode_tokens(ids)
        result = {lp.token_id: Logprob(lp.logprob, lp.rank, texts[0])}
        for rank, (token, value, text) in enumerate(
            zip(lp.top_token_ids, lp.top_logprobs, texts[1:], strict=True), start=1
        ):
            result.setdefault(token, Logprob(value, rank, text))
        return result

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    def _decode_tokens(self, ids: list[int]) -> list[str]:
        """Each token decoded on its own (vLLM's ``decoded_token``), cached per token id."""
        missing = [t for t in ids if t not in self._token_text]
        if missing:
            texts: list[str] = self.tokenizer.batch_decode([[t] for t in missing])
            self._token_text.update(zip(missing, texts, strict=True))
        return [self._token_text[t] for t in ids]

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
        params = state.request.params
        kind = params.output_kind
        done = state.finished
        if state.beam is not None:
            completions = self._beam_completions(state) if done else None
        elif done or (kind is not RequestOutputKind.FINAL_ONLY and params.num_samples == params.n):
            completions = self._completions(state, kind is RequestOutputKind.DELTA)
        else:
            completions = None
        if completions is None:
            return None
        prompt_logprobs = state.prompt_logprobs
        if prompt_logprobs is not None and kind is RequestOutputKind.DELTA:
            ready = state.metrics.first_token_time is not None
            prompt_logprobs = prompt_logprobs if ready and not state.prompt_logprobs_sent else None
            state.prompt_logprobs_sent = state.prompt_logprobs_sent or ready
        return RequestOutput(
            request_id=state.request.request_id,
            prompt=state.request.prompt,
            prompt_token_ids=state.request.prompt_token_ids,
            outputs=completions,
            finished=done,
            metrics=state.metrics,
            num_cached_tokens=state.seqs[0].num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )

    def _completions(self, state: _RequestState, delta: bool) -> list[CompletionOutput]:
        """Each sequence's output so far (or, with ``delta``, what changed since the last call).
        With best_of > n, only the n with the highest cumulative logprob, ranked, at the end."""
        params = state.request.params
        seqs = list(state.seqs)
        if params.num_samples > params.n:
            seqs.sort(key=lambda s: s.cumulative_logprob, reverse=True)
            seqs = seqs[: params.n]
        completions = []
        for index, seq in enumerate(seqs):
            out = state.outs[seq.index]
            ended = seq.finish_reason is not None
            text = out.detokenizer.output_text(ended)
            tokens, logprobs = seq.output_token_ids, out.logprobs
            if delta:
                if not (len(text) > out.sent_chars or len(tokens) > out.sent_tokens) and (
                    out.sent_finish or not ended
                ):
                    continue
                text, tokens = text[out.sent_chars :], tokens[out.sent_tokens :]
                logprobs = None if logprobs is None else logprobs[out.sent_tokens :]
                out.sent_chars += len(text)
                out.sent_tokens += len(tokens)
                out.sent_finish = ended
            completions.append(
                CompletionOutput(
                    index=index,
                    text=text,
                    token_ids=list(tokens),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=None if logprobs is None else list(logprobs),
                )
            )
        return completions

    def _beam_completions(self, state: _RequestState) -> list[CompletionOutput]:
        """The finished hypotheses, best first; an aborted search reports its live beams."""
        assert state.beam is not None
        if not state.beam.done:
            return [
                CompletionOutput(
                    index=i,
                    text=self._decode(b.output_token_ids),
                    token_ids=list(b.output_token_ids),
                    finish_reason=b.finish_reason,
                    cumulative_logprob=b.cumulative_logprob,
                )
                for i, b in enumerate(state.seqs)
            ]
        return [
            CompletionOutput(
                index=i,
                text=self._decode(h.token_ids),
                token_ids=h.token_ids,
                finish_reason=h.finish_reason,
                cumulative_logprob=h.cumulative_logprob,
            )
            for i, h in enumerate(state.beam.finished)
        ]
