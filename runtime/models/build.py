"""A rank's model, ready to run: its attention backend, its weights (its slice of them, with
tensor parallelism), quantized as the engine args say."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ladle.runtime.attention import KVCacheSpec
from ladle.runtime.attention.registry import select_backend
from ladle.runtime.config import EngineArgs
from ladle.runtime.models.config import ModelConfig
from ladle.runtime.models.llama import LlamaModel
from ladle.runtime.models.loader import iter_safetensors
from ladle.runtime.parallel.group import Shard
from ladle.runtime.quantization import awq
from ladle.runtime.quantization.apply import quantize_at_load


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    dtype: torch.dtype = getattr(torch, name)
    return dtype


def build_model(
    args: EngineArgs,
    cfg: ModelConfig,
    model_path: Path,
    device: torch.device,
    dtype: torch.dtype,
    shard: Shard | None = None,
) -> tuple[LlamaModel, KVCacheSpec]:
    """The model and the shape of its KV cache (this rank's KV heads)."""
    local = cfg if shard is None else shard.layout.local_config(cfg)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, args.kv_cache_dtype)
    spec = KVCacheSpec(
        local.num_layers, local.num_kv_heads, local.head_dim, args.block_size, kv_dtype
    )
    backend = select_backend(args.attention_backend, device, kv_dtype, dtype)
    model = LlamaModel(local, backend(spec, device), dtype, device, shard)
    model.load_weights(iter_safetensors(model_path))
    quantization = args.quantization_config()
    calibration = None
    if shard is not None and quantization.enabled and quantization.uses_awq:
        whole = whole_calibration(args, cfg, model_path)
        calibration = whole.shard(shard.layout, cfg, quantization.group_size)
    quantize_at_load(model, quantization, model_path, calibration)
    return model, spec


def whole_calibration(args: EngineArgs, cfg: ModelConfig, model_path: Path) -> awq.Calibration:
    """AWQ's calibration of the whole model, which no rank's slice can compute: a stored one,
    else computed by the first rank to ask, on an unsplit copy in host memory (once: it is
    cached, and the other ranks wait for it)."""
    quantization = args.quantization_config()
    with awq.calibrating(model_path, quantization):
        found = awq.stored_calibration(model_path, quantization)
        if found is not None:
            return found
        plain = dataclasses.replace(
            args, tensor_parallel_size=1, nnodes=1, node_rank=0, quantization=None,
            quantization_method=None, quantization_group_size=None, device="cpu",
            attention_backend="auto",
        )  # fmt: skip
        cpu = torch.device("cpu")
        model, _ = build_model(plain, cfg, model_path, cpu, resolve_dtype("auto", cpu))
        return awq.calibrate_and_save(model, quantization, model_path)


def kv_budget_blocks(
    args: EngineArgs, model: LlamaModel, spec: KVCacheSpec, mirror: KVCacheSpec | None = None
) -> int:
    """KV blocks that fit beside the weights: on a GPU, what its memory leaves after the
    step's activations and logits; on the CPU, ``--kv-cache-memory``, which the ranks of a
    split model share (they share the host's memory, and a pod's limit). A draft model's
    cache (``mirror``) has a block for each of the model's, out of the same budget."""
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    device = model.device
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cfg = model.config
        width = 4 * cfg.hidden_size + 2 * cfg.intermediate_size + cfg.q_size
        activations = 4 * args.max_num_batched_tokens * width * 4
        logits = args.max_num_seqs * cfg.vocab_size * 4 * 4
        budget = int(total * args.gpu_memory_utilization) - (total - free)
        budget -= activations + logits
    else:
        budget = args.kv_cache_memory // args.tensor_parallel_size
    per_block = spec.bytes_per_block + (0 if mirror is None else mirror.bytes_per_block)
    return int(budget // per_block)
