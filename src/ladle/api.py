"""The InferenceService and GPUPool API, as every component reads it (the operator, and the
gateway for its names, labels and variants).

``crds/`` is the contract: by the time an object reaches Ladle, the API server has
validated and defaulted it. Parsing therefore only maps JSON onto typed values; the fallbacks
mirror the CRD defaults so that objects stored before a default existed still reconcile.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

GROUP = "ladle.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ISVC_KIND = "InferenceService"
ISVC_PLURAL = "inferenceservices"
POOL_KIND = "GPUPool"
POOL_PLURAL = "gpupools"

# Labels on every child; the first two are also the Deployment/Service selectors.
LABEL_ISVC = "ladle.dev/inferenceservice"
LABEL_VARIANT = "ladle.dev/variant"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "ladle-operator"
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
# On runtime pods: the GPUPool whose quota they count against, so that pods still draining
# after their InferenceService is gone keep counting.
LABEL_POOL = "ladle.dev/gpupool"
# Keeps a GPUPool that InferenceServices still use from being deleted under them.
POOL_FINALIZER = "ladle.dev/in-use"

# The node label NVIDIA GPU feature discovery sets; GPUPool.spec.product selects on it.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"

# The variants of an InferenceService: the revision that serves, and the one on trial.
STABLE = "stable"
CANARY = "canary"
# One-shot rollout commands (promote, abort, retry): the operator acts, then removes it.
ROLLOUT_ACTION_ANNOTATION = "ladle.dev/rollout-action"
ROLLOUT_ACTIONS = ("promote", "abort", "retry")
# "enabled": the runtime pods run with --profile-dir on a bounded emptyDir (docs/pipeline.md).
PROFILING_ANNOTATION = "ladle.dev/profiling"

JSON = dict[str, Any]


def rfc3339(epoch: float | None = None, digits: int = 0) -> str:
    """A Kubernetes timestamp (now, by default): metav1.Time has whole seconds, metav1.MicroTime
    (a Lease's times) six digits, and a rollout's status keeps milliseconds (3)."""
    scale = 10**digits
    whole, part = divmod(round((time.time() if epoch is None else epoch) * scale), scale)
    text = datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    return f"{text}.{part:0{digits}d}Z" if digits else f"{text}Z"


def parse_rfc3339(stamp: object) -> float | None:
    """Seconds since the epoch of a Time or MicroTime; None if absent or unreadable."""
    if not isinstance(stamp, str) or not stamp:
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


SourceKind = Literal["builtin", "pvc", "image"]


@dataclass(frozen=True)
class ModelSource:
    """Where the runtime loads weights from: its embedded default, a PVC, or its own image."""

    kind: SourceKind
    claim_name: str | None = None
    path: str | None = None


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


@dataclass(frozen=True)
class EngineSettings:
    """Engine knobs; each maps onto one ``ladle serve`` flag (None: the runtime's default)."""

    dtype: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_memory: str | None = None
    seed: int | None = None
    max_waiting_requests: int | None = None
    drain_timeout_seconds: int = 30


@dataclass(frozen=True)
class Resources:
    gpus: int = 1
    cpu: str | None = None
    memory: str | None = None


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


@dataclass(frozen=True)
class ObjectMeta:
    namespace: str
    name: str
    uid: str
    generation: int
    created: str
    deleting: bool
    finalizers: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


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


@dataclass(frozen=True)
class Requirement:
    """One ``matchExpressions`` entry of a metav1.LabelSelector."""

    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        inside = labels.get(self.key) in self.values
        return inside if self.operator == "In" else not inside


@dataclass(frozen=True)
class LabelSelector:
    """metav1.LabelSelector: every label and every expression must match (empty: everything)."""

    match_labels: Mapping[str, str]
    expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.expressions
        )

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for r in self.expressions:
            if r.operator == "Exists":
                parts.append(r.key)
            elif r.operator == "DoesNotExist":
                parts.append(f"!{r.key}")
            else:
                word = "in" if r.operator == "In" else "notin"
                parts.append(f"{r.key} {word} ({','.join(sorted(r.values))})")
        return ",".join(parts) or "(everything)"


@dataclass(frozen=True)
class GPUPoolSpec:
    node_selector: Mapping[str, str]
    tolerations: tuple[JSON, ...]
    resource_name: str = DEFAULT_GPU_RESOURCE
    product: str | None = None
    quota_gpus: int | None = None
    # Which namespaces may run InferenceServices in the pool (None: every namespace).
    namespace_selector: LabelSelector | None = None

    def scheduling_selector(self) -> dict[str, str]:
        """The nodeSelector a runtime pod gets: the pool's own plus its GPU product."""
        selector = dict(self.node_selector)
        if self.product:
            selector[GPU_PRODUCT_LABEL] = self.product
        return selector


@dataclass(frozen=True)
class GPUPool:
    meta: ObjectMeta
    spec: GPUPoolSpec
    status: JSON


def _meta(obj: Mapping[str, Any]) -> ObjectMeta:
    meta = obj.get("metadata") or {}
    return ObjectMeta(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta["name"]),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        created=str(meta.get("creationTimestamp") or ""),
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(str(f) for f in meta.get("finalizers") or ()),
        annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
    )


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


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
        dtype=_opt_str(raw.get("dtype")),
        max_model_len=_opt_int(raw.get("maxModelLen")),
        max_num_seqs=_opt_int(raw.get("maxNumSeqs")),
        max_num_batched_tokens=_opt_int(raw.get("maxNumBatchedTokens")),
        block_size=_opt_int(raw.get("blockSize")),
        enable_prefix_caching=None if prefix is None else bool(prefix),
        gpu_memory_utilization=None if util is None else float(util),
        kv_cache_memory=_opt_str(raw.get("kvCacheMemory")),
        seed=_opt_int(raw.get("seed")),
        max_waiting_requests=_opt_int(raw.get("maxWaitingRequests")),
        drain_timeout_seconds=int(raw.get("drainTimeoutSeconds", 30)),
    )


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
        method=_opt_str(raw.get("method")),
        group_size=_opt_int(raw.get("groupSize")),
    )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


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
            min_top1=_opt_float(quality.get("minTop1Agreement")),
            max_kld=_opt_float(quality.get("maxKLD")),
            max_ppl_increase=_opt_float(quality.get("maxPerplexityIncrease")),
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


def parse_spec(spec: Mapping[str, Any]) -> InferenceServiceSpec:
    model = spec.get("model") or {}
    runtime = spec.get("runtime") or {}
    resources = spec.get("resources") or {}
    secret = spec.get("apiKeySecret")
    return InferenceServiceSpec(
        served_model_name=str(model["name"]),
        source=parse_source(model.get("source")),
        quantization=parse_quantization(spec.get("quantization")),
        runtime_image=_opt_str(runtime.get("image")),
        startup_timeout_seconds=int(runtime.get("startupTimeoutSeconds", 600)),
        engine=parse_engine(spec.get("engine")),
        resources=Resources(
            gpus=int(resources.get("gpus", 1)),
            cpu=_opt_str(resources.get("cpu")),
            memory=_opt_str(resources.get("memory")),
        ),
        gpu_pool=_opt_str(spec.get("gpuPool")),
        replicas=int(spec.get("replicas", 1)),
        min_replicas=int(spec.get("minReplicas", 1)),
        max_replicas=_opt_int(spec.get("maxReplicas")),
        api_key_secret=(
            SecretKeyRef(name=str(secret["name"]), key=str(secret.get("key", "api-key")))
            if secret
            else None
        ),
        autoscaling=parse_autoscaling(spec.get("autoscaling")),
        rollout=parse_rollout(spec.get("rollout")),
    )


def parse_isvc(obj: Mapping[str, Any]) -> InferenceService:
    spec = dict(obj.get("spec") or {})
    return InferenceService(
        meta=_meta(obj),
        spec=parse_spec(spec),
        status=dict(obj.get("status") or {}),
        raw_spec=spec,
    )


def parse_selector(raw: Mapping[str, Any] | None) -> LabelSelector | None:
    if raw is None:
        return None
    return LabelSelector(
        match_labels={str(k): str(v) for k, v in (raw.get("matchLabels") or {}).items()},
        expressions=tuple(
            Requirement(
                str(e["key"]), e["operator"], frozenset(str(v) for v in e.get("values") or ())
            )
            for e in raw.get("matchExpressions") or ()
        ),
    )


def parse_pool(obj: Mapping[str, Any]) -> GPUPool:
    spec = obj.get("spec") or {}
    quota = spec.get("quota") or {}
    return GPUPool(
        meta=_meta(obj),
        spec=GPUPoolSpec(
            node_selector={str(k): str(v) for k, v in (spec.get("nodeSelector") or {}).items()},
            tolerations=tuple(dict(t) for t in spec.get("tolerations") or ()),
            resource_name=str(spec.get("resourceName") or DEFAULT_GPU_RESOURCE),
            product=_opt_str(spec.get("product")),
            quota_gpus=_opt_int(quota.get("gpus")),
            namespace_selector=parse_selector(spec.get("namespaceSelector")),
        ),
        status=dict(obj.get("status") or {}),
    )
