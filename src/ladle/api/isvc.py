"""The InferenceService: what a service serves (model, quantization, engine), on what (resources,
pool, replicas), how it scales, and how a change reaches its pods (the rollout)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ladle.api.inference_pool import InferencePoolSpec, parse_inference_pool
from ladle.api.meta import ObjectMeta, opt_float, opt_int, opt_str, parse_meta
from ladle.api.names import JSON
from ladle.api.traffic import TrafficSpec, parse_traffic

SourceKind = Literal["builtin", "pvc", "image"]


@dataclass(frozen=True)
class ModelSource:
    """Where the runtime loads weights from: its embedded default, a PVC, or its own image."""

    kind: SourceKind
    claim_name: str | None = None
    path: str | None = None


@dataclass(frozen=True)
class AdapterSpec:
    """A LoRA adapter served on top of the model under its own OpenAI ``model`` name; its
    source is a PVC or the runtime image, as the model's may be."""

    name: str
    source: ModelSource


@dataclass(frozen=True)
class Quantization:
    """What a variant serves: weight format (quantized at load) and KV-cache dtype.

    ``method`` and ``group_size`` stay None unless set, so the runtime's defaults apply."""

    weights: str = "none"
    kv_cache: str = "auto"
    method: str | None = None
    group_size: int | None = None

    def label(self) -> str:
        """A short name for status and logs: none, int8, int4-awq-g64, int8+kv-int8."""
        parts = [self.weights]
        if self.method is not None:
            parts.append(self.method)
        if self.group_size is not None:
            parts.append(f"g{self.group_size}")
        label = "-".join(parts)
        return label if self.kv_cache == "auto" else f"{label}+kv-{self.kv_cache}"


# The engine's default of --max-num-seqs: the sequences one pod runs at once, and so the
# gateway's default number of slots per pod.
DEFAULT_MAX_NUM_SEQS = 256


@dataclass(frozen=True)
class SpeculativeSpec:
    """``engine.speculative``: ``--speculative-config``, in vLLM's keys when rendered."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    quantization: str | None = None

    def config(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
        }
        for key in ("prompt_lookup_min", "prompt_lookup_max", "quantization"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass(frozen=True)
class EngineSettings:
    """Engine knobs; each maps onto one ``ladle serve`` flag (None: the runtime's default)."""

    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    # Ladle's pods order by the gateway's bands (vLLM's and ``ladle serve``'s default is fcfs).
    scheduling_policy: str = "priority"
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory: str | None = None
    seed: int | None = None
    max_waiting_requests: int | None = None
    drain_timeout_seconds: int = 30
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None
    speculative: SpeculativeSpec | None = None


@dataclass(frozen=True)
class Resources:
    gpus: int = 1
    cpu: str | None = None
    memory: str | None = None


@dataclass(frozen=True)
class Parallelism:
    """How one replica splits its model: over ``tensor`` GPUs in all, on ``nodes`` pods (one
    per node: a leader that serves and ``nodes - 1`` workers), ``tensor / nodes`` GPUs each."""

    tensor: int = 1
    nodes: int = 1


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``: what the scaling loop aims at, and how fast it may move.

    Durations are seconds; the replica bounds are the service's min/maxReplicas."""

    target_concurrency: float | None = 16.0
    target_kv_cache_usage: float | None = None
    stable_window_seconds: float = 60.0
    panic_window_percent: float = 10.0
    panic_threshold_percent: float = 200.0
    max_scale_up_rate: float = 1000.0
    max_scale_down_rate: float = 2.0
    scale_down_delay_seconds: float = 30.0
    scale_to_zero_grace_period_seconds: float = 30.0


@dataclass(frozen=True)
class ConfigMapKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class QualityGateSpec:
    """``spec.rollout.analysis.quality``: online ``ladle eval`` between a stable and a canary
    pod. A threshold left None takes the default for the canary's quantization."""

    enabled: bool = True
    min_top1: float | None = None
    max_kld: float | None = None
    max_ppl_increase: float | None = None
    # The gate runs before any traffic moves, and again at the first step this heavy (0: not).
    recheck_at_weight: int = 50
    prompts: ConfigMapKeyRef | None = None


@dataclass(frozen=True)
class SLOGateSpec:
    """``spec.rollout.analysis.slo``: canary over stable, as ratios; 0 turns a gate off."""

    max_error_rate_ratio: float = 2.0
    # Error rates below this count as this, so a clean stable does not make one error fatal.
    error_rate_floor: float = 0.01
    max_ttft_p95_ratio: float = 1.5
    max_tpot_p95_ratio: float = 1.5


@dataclass(frozen=True)
class RolloutSpec:
    """``spec.rollout``: how a change to what the pods run reaches them (a canary)."""

    steps: tuple[int, ...]
    interval_seconds: int = 60
    min_requests: int = 20
    failure_limit: int = 2
    progress_deadline_seconds: int = 600
    paused: bool = False
    manual_promotion: bool = False
    quality: QualityGateSpec = QualityGateSpec()
    slo: SLOGateSpec = SLOGateSpec()


# The endpoint picker's ext_proc port in GAIE's own chart.
@dataclass(frozen=True)
class TracingSpec:
    """Where a service's pods send traces; None: the operator's (the chart's) setting."""

    endpoint: str | None = None
    sampling_ratio: float | None = None


@dataclass(frozen=True)
class InferenceServiceSpec:
    served_model_name: str
    source: ModelSource
    quantization: Quantization = Quantization()
    runtime_image: str | None = None
    startup_timeout_seconds: int = 600
    engine: EngineSettings = EngineSettings()
    resources: Resources = Resources()
    gpu_pool: str | None = None
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int | None = None
    api_key_secret: SecretKeyRef | None = None
    autoscaling: AutoscalingSpec | None = None
    rollout: RolloutSpec | None = None
    traffic: TrafficSpec = field(default_factory=TrafficSpec)
    inference_pool: InferencePoolSpec = field(default_factory=InferencePoolSpec)
    tracing: TracingSpec = TracingSpec()
    # None: LoRA off. A list, even empty: the pods run --enable-lora and follow it.
    adapters: tuple[AdapterSpec, ...] | None = None
    parallelism: Parallelism = Parallelism()

    @property
    def gpus_per_replica(self) -> int:
        """What a replica holds of its pool: every GPU of every pod of its group."""
        return self.resources.gpus * self.parallelism.nodes


@dataclass(frozen=True)
class InferenceService:
    meta: ObjectMeta
    spec: InferenceServiceSpec
    status: JSON
    # The spec as stored: a variant that runs another revision re-parses it with its own
    # template (``revisions.with_template``).
    raw_spec: JSON = field(default_factory=dict, compare=False, repr=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.meta.namespace, self.meta.name)

    @property
    def requested_replicas(self) -> int:
        """The replicas this service asks its pool for: spec.replicas, or with autoscaling the
        scaling loop's last decision (kept in status, so a new leader starts from it), and
        spec.replicas within the bounds until the first one."""
        spec = self.spec
        if spec.autoscaling is None:
            return spec.replicas
        decided = (self.status.get("autoscaling") or {}).get("desiredReplicas")
        wanted = int(decided) if isinstance(decided, int) else spec.replicas
        return max(spec.min_replicas, min(wanted, spec.max_replicas or wanted))


def parse_source(raw: Mapping[str, Any] | None) -> ModelSource:
    raw = raw or {}
    if "pvc" in raw:
        pvc = raw["pvc"]
        return ModelSource("pvc", claim_name=str(pvc["claimName"]), path=str(pvc["path"]))
    if "image" in raw:
        return ModelSource("image", path=str(raw["image"]["path"]))
    return ModelSource("builtin")


def parse_engine(raw: Mapping[str, Any] | None) -> EngineSettings:
    raw = raw or {}
    util = raw.get("gpuMemoryUtilization")
    prefix = raw.get("enablePrefixCaching")
    return EngineSettings(
        dtype=opt_str(raw.get("dtype")),
        max_model_len=opt_int(raw.get("maxModelLen")),
        max_num_seqs=opt_int(raw.get("maxNumSeqs")),
        scheduling_policy=str(raw.get("schedulingPolicy", "priority")),
        max_num_batched_tokens=opt_int(raw.get("maxNumBatchedTokens")),
        block_size=opt_int(raw.get("blockSize")),
        enable_prefix_caching=None if prefix is None else bool(prefix),
        gpu_memory_utilization=None if util is None else float(util),
        kv_cache_memory=opt_str(raw.get("kvCacheMemory")),
        seed=opt_int(raw.get("seed")),
        max_waiting_requests=opt_int(raw.get("maxWaitingRequests")),
        drain_timeout_seconds=int(raw.get("drainTimeoutSeconds", 30)),
        max_loras=opt_int(raw.get("maxLoras")),
        max_lora_rank=opt_int(raw.get("maxLoraRank")),
        max_cpu_loras=opt_int(raw.get("maxCpuLoras")),
        speculative=parse_speculative(raw.get("speculative")),
    )


def parse_speculative(raw: Mapping[str, Any] | None) -> SpeculativeSpec | None:
    if raw is None:
        return None
    return SpeculativeSpec(
        str(raw["method"]),
        int(raw["numSpeculativeTokens"]),
        opt_int(raw.get("promptLookupMin")),
        opt_int(raw.get("promptLookupMax")),
        raw.get("quantization"),
    )


def parse_adapters(raw: Any) -> tuple[AdapterSpec, ...] | None:
    if raw is None:
        return None
    return tuple(AdapterSpec(str(a["name"]), parse_source(a.get("source"))) for a in raw)


def parse_autoscaling(raw: Mapping[str, Any] | None) -> AutoscalingSpec | None:
    if raw is None:
        return None
    concurrency = raw.get("targetConcurrency")
    kv = raw.get("targetKVCacheUsage")
    defaults = AutoscalingSpec()

    def seconds(key: str, default: float) -> float:
        return float(raw.get(key, default))

    return AutoscalingSpec(
        # Concurrency is the signal unless the spec names only the KV cache.
        target_concurrency=(
            float(concurrency)
            if concurrency is not None
            else (defaults.target_concurrency if kv is None else None)
        ),
        target_kv_cache_usage=None if kv is None else float(kv),
        stable_window_seconds=seconds("stableWindowSeconds", defaults.stable_window_seconds),
        panic_window_percent=seconds("panicWindowPercent", defaults.panic_window_percent),
        panic_threshold_percent=seconds("panicThresholdPercent", defaults.panic_threshold_percent),
        max_scale_up_rate=seconds("maxScaleUpRate", defaults.max_scale_up_rate),
        max_scale_down_rate=seconds("maxScaleDownRate", defaults.max_scale_down_rate),
        scale_down_delay_seconds=seconds(
            "scaleDownDelaySeconds", defaults.scale_down_delay_seconds
        ),
        scale_to_zero_grace_period_seconds=seconds(
            "scaleToZeroGracePeriodSeconds", defaults.scale_to_zero_grace_period_seconds
        ),
    )


def parse_quantization(raw: Mapping[str, Any] | str | None) -> Quantization:
    # Objects stored while spec.quantization was a string (only "none" was allowed) still parse.
    if raw is None or isinstance(raw, str):
        return Quantization(weights=raw or "none")
    return Quantization(
        weights=str(raw.get("weights", "none")),
        kv_cache=str(raw.get("kvCache", "auto")),
        method=opt_str(raw.get("method")),
        group_size=opt_int(raw.get("groupSize")),
    )


def parse_rollout(raw: Mapping[str, Any] | None) -> RolloutSpec | None:
    if not raw:
        return None
    analysis = raw.get("analysis") or {}
    quality = analysis.get("quality") or {}
    slo = analysis.get("slo") or {}
    prompts = quality.get("prompts")
    return RolloutSpec(
        steps=tuple(int(w) for w in raw.get("steps") or (100,)),
        interval_seconds=int(raw.get("intervalSeconds", 60)),
        min_requests=int(raw.get("minRequests", 20)),
        failure_limit=int(raw.get("failureLimit", 2)),
        progress_deadline_seconds=int(raw.get("progressDeadlineSeconds", 600)),
        paused=bool(raw.get("paused", False)),
        manual_promotion=bool(raw.get("manualPromotion", False)),
        quality=QualityGateSpec(
            enabled=bool(quality.get("enabled", True)),
            min_top1=opt_float(quality.get("minTop1Agreement")),
            max_kld=opt_float(quality.get("maxKLD")),
            max_ppl_increase=opt_float(quality.get("maxPerplexityIncrease")),
            recheck_at_weight=int(quality.get("recheckAtWeight", 50)),
            prompts=(
                ConfigMapKeyRef(str(prompts["configMapName"]), str(prompts["key"]))
                if prompts
                else None
            ),
        ),
        slo=SLOGateSpec(
            max_error_rate_ratio=float(slo.get("maxErrorRateRatio", 2.0)),
            error_rate_floor=float(slo.get("errorRateFloor", 0.01)),
            max_ttft_p95_ratio=float(slo.get("maxTTFTP95Ratio", 1.5)),
            max_tpot_p95_ratio=float(slo.get("maxTPOTP95Ratio", 1.5)),
        ),
    )


def parse_tracing(raw: Mapping[str, Any] | None) -> TracingSpec:
    raw = raw or {}
    return TracingSpec(
        endpoint=opt_str(raw.get("endpoint")), sampling_ratio=opt_float(raw.get("samplingRatio"))
    )


def parse_spec(spec: Mapping[str, Any]) -> InferenceServiceSpec:
    model = spec.get("model") or {}
    runtime = spec.get("runtime") or {}
    resources = spec.get("resources") or {}
    secret = spec.get("apiKeySecret")
    return InferenceServiceSpec(
        served_model_name=str(model["name"]),
        source=parse_source(model.get("source")),
        quantization=parse_quantization(spec.get("quantization")),
        runtime_image=opt_str(runtime.get("image")),
        startup_timeout_seconds=int(runtime.get("startupTimeoutSeconds", 600)),
        engine=parse_engine(spec.get("engine")),
        resources=Resources(
            gpus=int(resources.get("gpus", 1)),
            cpu=opt_str(resources.get("cpu")),
            memory=opt_str(resources.get("memory")),
        ),
        gpu_pool=opt_str(spec.get("gpuPool")),
        replicas=int(spec.get("replicas", 1)),
        min_replicas=int(spec.get("minReplicas", 1)),
        max_replicas=opt_int(spec.get("maxReplicas")),
        api_key_secret=(
            SecretKeyRef(name=str(secret["name"]), key=str(secret.get("key", "api-key")))
            if secret
            else None
        ),
        autoscaling=parse_autoscaling(spec.get("autoscaling")),
        rollout=parse_rollout(spec.get("rollout")),
        traffic=parse_traffic(spec),
        inference_pool=parse_inference_pool(spec.get("inferencePool")),
        tracing=parse_tracing(spec.get("tracing")),
        adapters=parse_adapters(spec.get("adapters")),
        parallelism=parse_parallelism(spec.get("parallelism"), int(resources.get("gpus", 1))),
    )


def parse_parallelism(raw: Mapping[str, Any] | None, gpus: int) -> Parallelism:
    """spec.parallelism, or one pod splitting over its own GPUs (CEL holds tensor to gpus ×
    nodes)."""
    raw = raw or {}
    nodes = int(raw.get("nodes", 1))
    return Parallelism(tensor=int(raw.get("tensor", max(gpus, 1) * nodes)), nodes=nodes)


def parse_isvc(obj: Mapping[str, Any]) -> InferenceService:
    spec = dict(obj.get("spec") or {})
    return InferenceService(
        meta=parse_meta(obj),
        spec=parse_spec(spec),
        status=dict(obj.get("status") or {}),
        raw_spec=spec,
    )
