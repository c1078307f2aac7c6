"""``ladle operator``: flags, each also settable as a ``LADLE_OPERATOR_*`` environment variable.

``ladle.settings`` resolves them when the command runs, by the rule every subcommand follows
(``--lease-namespace`` is ``LADLE_OPERATOR_LEASE_NAMESPACE``; the command line wins), so a bad
value never breaks another subcommand (or ``--help``) and is reported in one line naming it.

Imports only the standard library at import time; kopf and friends load when the command runs.
"""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path

from ladle.api import GatewayRef
from ladle.flag_types import Invalid, address, http_url, integer, number, seconds, text
from ladle.operator.config import DEFAULT_RUNTIME_IMAGE
from ladle.settings import Default, SettingError, add_log_level

SYSTEM_NAMESPACE = "ladle-system"
# `ladle serve --env-profile`'s names (ladle.runtime.server.profiles, which desired.py checks).
RUNTIME_ENV_PROFILES = ("dev", "staging", "prod")
# Where a pod finds its own namespace (client-go's in-cluster convention).
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_lease_namespace() -> str:
    """The pod's own namespace in a cluster, else the namespace the chart installs into, so
    that an operator run by hand beside an installed one competes for the same Lease."""
    try:
        return POD_NAMESPACE_FILE.read_text().strip() or SYSTEM_NAMESPACE
    except OSError:
        return SYSTEM_NAMESPACE


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "operator",
        help="run the Kubernetes operator (InferenceService and GPUPool)",
        description="Reconcile InferenceServices and GPUPools. Every flag can also be set as "
        "an environment variable named LADLE_OPERATOR_ and the flag in upper case with "
        "dashes as underscores (--lease-namespace: LADLE_OPERATOR_LEASE_NAMESPACE); the "
        "command line wins.",
    )
    parser.add_argument(
        "--metrics-bind-address",
        type=address,
        default="127.0.0.1:8080",
        metavar="HOST:PORT",
        help="where /metrics, /healthz and /readyz listen",
    )
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hold a coordination.k8s.io Lease so that one replica acts at a time",
    )
    parser.add_argument(
        "--lease-namespace",
        type=text,
        default=Default(default_lease_namespace, f"the pod's namespace, else {SYSTEM_NAMESPACE}"),
        help="namespace of the leader Lease (the chart's release namespace)",
    )
    parser.add_argument(
        "--lease-name", type=text, default="ladle-operator", help="name of the Lease"
    )
    parser.add_argument(
        "--identity",
        type=text,
        default=Default(lambda: f"{socket.gethostname()}-{os.getpid()}", "HOSTNAME-PID"),
        help="this instance's name in the Lease",
    )
    parser.add_argument(
        "--lease-duration",
        type=integer(2, what="a whole number of seconds", unit="s"),
        default=15,
        metavar="SECONDS",
        help="seconds a standby waits after the last renewal before it takes the Lease",
    )
    parser.add_argument(
        "--renew-deadline",
        type=seconds(0.5),
        default=10.0,
        metavar="SECONDS",
        help="seconds after its last renewal at which a leader stops acting (< lease duration)",
    )
    parser.add_argument(
        "--retry-period",
        type=seconds(0.1),
        default=2.0,
        metavar="SECONDS",
        help="seconds between Lease renewals and acquisition attempts (< renew deadline)",
    )
    parser.add_argument(
        "--runtime-image",
        type=text,
        default=DEFAULT_RUNTIME_IMAGE,
        metavar="IMAGE",
        help="image for InferenceServices that set no spec.runtime.image",
    )
    parser.add_argument(
        "--cluster-domain",
        type=text,
        default="cluster.local",
        help="the cluster's DNS suffix, for status.url",
    )
    parser.add_argument(
        "--gateway-url",
        type=text,
        default=Default(None, "each service's own URL"),
        metavar="URL",
        help="the gateway's OpenAI base URL, written to every InferenceService's status.url",
    )
    parser.add_argument(
        "--gateway-namespace",
        type=text,
        default=Default(None, "none"),
        metavar="NAMESPACE",
        help="namespace of the gateway pods, whose in-flight and held counts the autoscaler reads",
    )
    parser.add_argument(
        "--gateway-selector",
        type=text,
        default=Default(None, "none"),
        metavar="SELECTOR",
        help="label selector of the gateway pods (with --gateway-namespace; the chart sets both)",
    )
    parser.add_argument(
        "--default-gpu-resource",
        type=text,
        default="nvidia.com/gpu",
        help="GPU resource name for InferenceServices without a gpuPool",
    )
    parser.add_argument(
        "--config-map-threshold-bytes",
        type=integer(0, what="a whole number of bytes"),
        default=256,
        metavar="BYTES",
        help="engine flags longer than this move from the pod's args into a ConfigMap",
    )
    parser.add_argument(
        "--runtime-env-profile",
        choices=RUNTIME_ENV_PROFILES,
        default=Default(None, "none"),
        help="the environment profile of every runtime pod's ladle serve, with that profile's "
        "probe timings (docs/operator.md#environment-profiles); the spec's fields still win",
    )
    parser.add_argument(
        "--runtime-otlp-traces-endpoint",
        type=http_url,
        default=Default(None, "none"),
        metavar="URL",
        help="every runtime pod sends its traces to this OTLP/HTTP collector, unless its "
        "spec.tracing names another",
    )
    parser.add_argument(
        "--runtime-trace-sample-ratio",
        type=number(0.0, 1.0),
        default=1.0,
        help="the share of new traces the runtime pods record, unless a spec.tracing says",
    )
    parser.add_argument(
        "--inference-gateway",
        type=gateway_ref,
        default=Default(None, "none"),
        metavar="NAMESPACE/NAME",
        help="where the cluster has the Gateway API Inference Extension and the Gateway API, "
        "route each service's model from this Gateway to its InferencePool (an HTTPRoute), "
        "unless its spec.inferencePool.gateway names another",
    )
    parser.add_argument(
        "--workers",
        type=integer(1),
        default=32,
        metavar="N",
        help="concurrent reconciles (a quarter of them wait for spec changes only)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=number(1, unit="s"),
        default=600.0,
        metavar="SECONDS",
        help="how often everything is listed and reconciled again besides watch events",
    )
    add_log_level(parser)
    parser.set_defaults(func=_run)


def gateway_ref(value: str) -> GatewayRef:
    namespace, sep, name = str(value).strip().partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise Invalid("expected NAMESPACE/NAME of a Gateway, such as gateways/inference")
    return GatewayRef(name, namespace)


def _run(args: argparse.Namespace) -> int:
    from ladle.operator.config import OperatorConfig
    from ladle.operator.leader import ElectionTiming

    try:
        timing = ElectionTiming(args.lease_duration, args.renew_deadline, args.retry_period)
    except ValueError as err:
        raise SettingError(f"--lease-duration, --renew-deadline, --retry-period: {err}") from None

    from ladle.kube import LoginError, login
    from ladle.operator.main import Options, run

    try:
        login()  # the connection every client will use: a kubeconfig mistake, said now
    except LoginError as err:
        raise SettingError(str(err)) from None

    host, port = args.metrics_bind_address
    return run(
        Options(
            config=OperatorConfig(
                runtime_image=args.runtime_image,
                cluster_domain=args.cluster_domain,
                gateway_url=args.gateway_url,
                gateway_namespace=args.gateway_namespace,
                gateway_selector=args.gateway_selector,
                default_gpu_resource=args.default_gpu_resource,
                config_map_threshold_bytes=args.config_map_threshold_bytes,
                runtime_env_profile=args.runtime_env_profile,
                runtime_otlp_traces_endpoint=args.runtime_otlp_traces_endpoint,
                runtime_trace_sample_ratio=args.runtime_trace_sample_ratio,
                inference_gateway=args.inference_gateway,
            ),
            metrics_host=host,
            metrics_port=port,
            leader_elect=args.leader_elect,
            lease_namespace=args.lease_namespace,
            lease_name=args.lease_name,
            identity=args.identity,
            timing=timing,
            workers=args.workers,
            resync_seconds=args.resync_seconds,
            log_level=args.log_level,
        )
    )
