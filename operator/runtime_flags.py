"""The ``ladle serve`` flags a runtime pod runs with: the spec's engine settings, keyed by flag
name as ``ladle serve --config`` reads them, and what the operator adds (the environment
profile, profiling, tracing)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ladle.api import PROFILING_ANNOTATION, InferenceService
from ladle.operator import groups
from ladle.operator.config import OperatorConfig
from ladle.operator.runtime_pod import (
    ADAPTERS_FILE,
    ADAPTERS_MOUNT,
    API_KEY_FILE,
    API_KEY_MOUNT,
    MODEL_MOUNT,
    PROFILE_MOUNT,
)
from ladle.quantity import quantity_to_int


def engine_config(isvc: InferenceService) -> dict[str, Any]:
    """The ``ladle serve`` settings, keyed by flag name (the same keys its --config YAML uses)."""
    spec = isvc.spec
    engine = spec.engine
    config: dict[str, Any] = {"served-model-name": spec.served_model_name}
    if spec.source.kind == "pvc":
        config["model"] = f"{MODEL_MOUNT}/{spec.source.path}"
    elif spec.source.kind == "image":
        config["model"] = spec.source.path
    optional: list[tuple[str, Any]] = [
        ("dtype", engine.dtype),
        ("max-model-len", engine.max_model_len),
        ("max-num-seqs", engine.max_num_seqs),
        ("scheduling-policy", engine.scheduling_policy),
        ("max-num-batched-tokens", engine.max_num_batched_tokens),
        ("block-size", engine.block_size),
        ("enable-prefix-caching", engine.enable_prefix_caching),
        ("gpu-memory-utilization", engine.gpu_memory_utilization),
        (
            "kv-cache-memory",
            None if engine.kv_cache_memory is None else quantity_to_int(engine.kv_cache_memory),
        ),
        ("seed", engine.seed),
        ("max-waiting-requests", engine.max_waiting_requests),
        (
            "tensor-parallel-size",
            spec.parallelism.tensor if spec.parallelism.tensor > 1 else None,
        ),
        (
            "speculative-config",
            None if engine.speculative is None else json.dumps(engine.speculative.config()),
        ),
    ]
    quant = spec.quantization
    if quant.weights != "none":
        optional += [
            ("quantization", quant.weights),
            ("quantization-method", quant.method),
            ("quantization-group-size", quant.group_size),
        ]
    if quant.kv_cache != "auto":
        optional.append(("kv-cache-dtype", quant.kv_cache))
    if spec.adapters is not None:
        config["enable-lora"] = True
        config["lora-modules-file"] = f"{ADAPTERS_MOUNT}/{ADAPTERS_FILE}"
        optional += [
            ("max-loras", engine.max_loras),
            ("max-lora-rank", engine.max_lora_rank),
            ("max-cpu-loras", engine.max_cpu_loras),
        ]
    config.update((key, value) for key, value in optional if value is not None)
    config.update(groups.group_settings(spec.parallelism.nodes))
    if spec.api_key_secret is not None:
        config["api-key-file"] = f"{API_KEY_MOUNT}/{API_KEY_FILE}"
    config["drain-timeout"] = engine.drain_timeout_seconds
    return config


@dataclass(frozen=True)
class Profiling:
    """What ``ladle.dev/profiling`` asks of the pods: whether they run with --profile-dir,
    and why not when it was asked for but cannot be (an Event says so)."""

    enabled: bool
    problem: tuple[str, str] | None = None  # (Event reason, message)


def profiling(isvc: InferenceService) -> Profiling:
    value = isvc.meta.annotations.get(PROFILING_ANNOTATION)
    if value is None or value == "disabled":
        return Profiling(False)
    if value != "enabled":
        return Profiling(
            False,
            (
                "InvalidProfilingAnnotation",
                f"{PROFILING_ANNOTATION}: {value!r} is neither 'enabled' nor 'disabled'; "
                "profiling stays off",
            ),
        )
    if isvc.spec.api_key_secret is None:
        return Profiling(
            False,
            (
                "ProfilingNeedsAPIKey",
                f"{PROFILING_ANNOTATION} is 'enabled' but spec.apiKeySecret is not set: "
                "ladle serve refuses --profile-dir without a key, so profiling stays off",
            ),
        )
    return Profiling(True)


def operator_settings(isvc: InferenceService, config: OperatorConfig) -> dict[str, Any]:
    """The ``ladle serve`` settings the operator adds to the spec's: the environment profile
    (a layer under every flag, so the spec's engine fields win), profiling, and tracing (the
    spec's, else the chart's)."""
    settings: dict[str, Any] = {}
    if config.runtime_env_profile is not None:
        settings["env-profile"] = config.runtime_env_profile
    if profiling(isvc).enabled:
        settings["profile-dir"] = PROFILE_MOUNT
    tracing = isvc.spec.tracing
    endpoint = tracing.endpoint or config.runtime_otlp_traces_endpoint
    if endpoint:
        settings["otlp-traces-endpoint"] = endpoint
        settings["trace-sample-ratio"] = (
            config.runtime_trace_sample_ratio
            if tracing.sampling_ratio is None
            else tracing.sampling_ratio
        )
    return settings


def render_flags(config: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in config.items():
        if isinstance(value, bool):
            args.append(f"--{key}" if value else f"--no-{key}")
        else:
            args.extend((f"--{key}", str(value)))
    return args
