"""Operator-wide settings that shape every child object (not per-InferenceService spec)."""

from __future__ import annotations

from dataclasses import dataclass

from ladle import __version__
from ladle.api import GatewayRef

DEFAULT_RUNTIME_IMAGE = f"ghcr.io/ladle-dev/ladle-runtime:{__version__}"


@dataclass(frozen=True)
class OperatorConfig:
    # Used when an InferenceService leaves spec.runtime.image unset; the chart sets it.
    runtime_image: str = DEFAULT_RUNTIME_IMAGE
    # The in-cluster DNS suffix, for status.url.
    cluster_domain: str = "cluster.local"
    # The gateway's OpenAI base URL: status.url when set (else each service's own URL).
    gateway_url: str | None = None
    # Where the gateway pods run, and their labels: the autoscaler reads their /metrics.
    gateway_namespace: str | None = None
    gateway_selector: str | None = None
    # The GPU resource for InferenceServices that name no GPUPool.
    default_gpu_resource: str = "nvidia.com/gpu"
    # The single server-side-apply field manager for everything the operator writes.
    field_manager: str = "ladle-operator"
    # Engine settings whose rendered flags exceed this many bytes move into a ConfigMap,
    # so that the pod spec stays readable and the config stays diffable.
    config_map_threshold_bytes: int = 256
    # `ladle serve --env-profile` for every runtime pod (dev, staging, prod), and the probe
    # timings that go with it (runtime_pod.RUNTIME_PROBES); None: neither.
    runtime_env_profile: str | None = None
    # Where runtime pods send traces, and the share of new traces they record, for services
    # whose spec.tracing leaves them unset; None: no tracing.
    runtime_otlp_traces_endpoint: str | None = None
    runtime_trace_sample_ratio: float = 1.0
    # The Gateway whose HTTPRoutes send each service's model to its InferencePool, for
    # services whose spec.inferencePool.gateway is unset; None: no route.
    inference_gateway: GatewayRef | None = None
