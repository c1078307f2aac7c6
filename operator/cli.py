"""``ladle operator``: flags, each also settable as a ``LADLE_OPERATOR_*`` environment variable.

Imports only the standard library at import time; kopf and friends load when the command runs.
"""

from __future__ import annotations

import argparse
import os
import socket


def _env(name: str, default: str) -> str:
    return os.environ.get(f"LADLE_OPERATOR_{name}", default)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "operator",
        help="run the Kubernetes operator (InferenceService and GPUPool)",
        description="Reconcile InferenceServices and GPUPools. Flags default to "
        "LADLE_OPERATOR_<FLAG> environment variables where set.",
    )
    parser.add_argument(
        "--metrics-bind-address",
        type=_address,
        default=_env("METRICS_BIND_ADDRESS", "127.0.0.1:8080"),
        help="HOST:PORT for /metrics, /healthz and /readyz (default: %(default)s)",
    )
    parser.add_argument(
        "--leader-elect",
        action=argparse.BooleanOptionalAction,
        default=_env("LEADER_ELECT", "true").lower() == "true",
        help="hold a coordination.k8s.io Lease so that one replica is active (default: on)",
    )
    parser.add_argument(
        "--lease-namespace",
        default=_env("NAMESPACE", "default"),
        help="namespace of the leader Lease (default: %(default)s)",
    )
    parser.add_argument("--lease-name", default=_env("LEASE_NAME", "ladle-operator"))
    parser.add_argument(
        "--identity",
        default=_env("IDENTITY", f"{socket.gethostname()}-{os.getpid()}"),
        help="this instance's name in the Lease (default: hostname-pid)",
    )
    parser.add_argument("--lease-duration", type=int, default=int(_env("LEASE_DURATION", "15")))
    parser.add_argument("--renew-deadline", type=float, default=float(_env("RENEW_DEADLINE", "10")))
    parser.add_argument("--retry-period", type=float, default=float(_env("RETRY_PERIOD", "2")))
    parser.add_argument(
        "--runtime-image",
        default=_env("RUNTIME_IMAGE", ""),
        help="image for InferenceServices that set no spec.runtime.image",
    )
    parser.add_argument("--cluster-domain", default=_env("CLUSTER_DOMAIN", "cluster.local"))
    parser.add_argument(
        "--gateway-url",
        default=_env("GATEWAY_URL", ""),
        help="the gateway's OpenAI base URL, written to every InferenceService's status.url "
        "(default: each service's own URL)",
    )
    parser.add_argument(
        "--default-gpu-resource",
        default=_env("DEFAULT_GPU_RESOURCE", "nvidia.com/gpu"),
        help="GPU resource name for InferenceServices without a gpuPool",
    )
    parser.add_argument(
        "--config-map-threshold-bytes",
        type=int,
        default=int(_env("CONFIG_MAP_THRESHOLD_BYTES", "256")),
        help="engine flags longer than this move into a ConfigMap (default: %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=int(_env("WORKERS", "32")))
    parser.add_argument(
        "--resync-seconds", type=float, default=float(_env("RESYNC_SECONDS", "600"))
    )
    parser.add_argument(
        "--log-level",
        default=_env("LOG_LEVEL", "INFO").upper(),
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
    )
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import dataclasses

    from ladle.operator.config import OperatorConfig
    from ladle.operator.leader import ElectionTiming
    from ladle.operator.main import Options, run

    config = OperatorConfig(
        cluster_domain=args.cluster_domain,
        gateway_url=args.gateway_url or None,
        default_gpu_resource=args.default_gpu_resource,
        config_map_threshold_bytes=args.config_map_threshold_bytes,
    )
    if args.runtime_image:
        config = dataclasses.replace(config, runtime_image=args.runtime_image)
    host, port = args.metrics_bind_address
    return run(
        Options(
            config=config,
            metrics_host=host,
            metrics_port=port,
            leader_elect=args.leader_elect,
            lease_namespace=args.lease_namespace,
            lease_name=args.lease_name,
            identity=args.identity,
            timing=ElectionTiming(args.lease_duration, args.renew_deadline, args.retry_period),
            workers=args.workers,
            resync_seconds=args.resync_seconds,
            log_level=args.log_level,
        )
    )
