"""``ladle operator``: flags, each also settable as a ``LADLE_OPERATOR_*`` environment variable.

One rule names the variables: ``LADLE_OPERATOR_`` and the flag in upper case with dashes as
underscores (``--lease-namespace`` is ``LADLE_OPERATOR_LEASE_NAMESPACE``); the command line
wins over the environment. Variables are read only when the command runs, so a bad value
never breaks another subcommand (or ``--help``), and it is reported in one line that names it.

Imports only the standard library at import time; kopf and friends load when the command runs.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ladle.operator.config import DEFAULT_RUNTIME_IMAGE

ENV_PREFIX = "LADLE_OPERATOR_"
SYSTEM_NAMESPACE = "ladle-system"
# Where a pod finds its own namespace (client-go's in-cluster convention).
POD_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
LOG_LEVELS = ("debug", "info", "warning", "error")
TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
FALSE = frozenset({"0", "false", "no", "off", "n", "f"})


class SettingError(ValueError):
    """A value that cannot be used; the message says what is allowed."""


def env_name(flag: str) -> str:
    return ENV_PREFIX + flag.upper().replace("-", "_")


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise SettingError("expected true or false (also yes/no, on/off, 1/0)")


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise SettingError("expected HOST:PORT, such as 127.0.0.1:8080")
    return host or "127.0.0.1", int(port)


def _number(kind: Callable[[str], Any], what: str, minimum: float) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        raw = text.strip()
        if what.endswith("seconds"):
            raw = raw.removesuffix("s")
        try:
            value = kind(raw)
        except ValueError:
            raise SettingError(f"expected {what}") from None
        if value < minimum:
            raise SettingError(f"expected {what} of at least {minimum:g}")
        return value

    return parse


def _text(text: str) -> str:
    if not text.strip():
        raise SettingError("must not be empty")
    return text.strip()


def _level(text: str) -> str:
    word = text.strip().lower()
    if word not in LOG_LEVELS:
        raise SettingError(f"expected one of {', '.join(LOG_LEVELS)}")
    return word


def default_lease_namespace() -> str:
    """The pod's own namespace in a cluster, else the namespace the chart installs into, so
    that an operator run by hand beside an installed one competes for the same Lease."""
    try:
        return POD_NAMESPACE_FILE.read_text().strip() or SYSTEM_NAMESPACE
    except OSError:
        return SYSTEM_NAMESPACE


@dataclass(frozen=True)
class Setting:
    flag: str
    parse: Callable[[str], Any]
    default: Callable[[], Any]
    shown: str  # the default, as help shows it
    help: str
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")


SETTINGS = (
    Setting(
        "metrics-bind-address",
        parse_address,
        lambda: ("127.0.0.1", 8080),
        "127.0.0.1:8080",
        "where /metrics, /healthz and /readyz listen",
        "HOST:PORT",
    ),
    Setting(
        "leader-elect",
        parse_bool,
        lambda: True,
        "true",
        "hold a coordination.k8s.io Lease so that one replica acts at a time",
    ),
    Setting(
        "lease-namespace",
        _text,
        default_lease_namespace,
        f"the pod's namespace, else {SYSTEM_NAMESPACE}",
        "namespace of the leader Lease (the chart's release namespace)",
    ),
    Setting("lease-name", _text, lambda: "ladle-operator", "ladle-operator", "name of the Lease"),
    Setting(
        "identity",
        _text,
        lambda: f"{socket.gethostname()}-{os.getpid()}",
        "HOSTNAME-PID",
        "this instance's name in the Lease",
    ),
    Setting(
        "lease-duration",
        _number(int, "a whole number of seconds", 2),
        lambda: 15,
        "15",
        "seconds a standby waits after the last renewal before it takes the Lease",
        "SECONDS",
    ),
    Setting(
        "renew-deadline",
        _number(float, "a number of seconds", 0.5),
        lambda: 10.0,
        "10",
        "seconds after its last renewal at which a leader stops acting (< lease duration)",
        "SECONDS",
    ),
    Setting(
        "retry-period",
        _number(float, "a number of seconds", 0.1),
        lambda: 2.0,
        "2",
        "seconds between Lease renewals and acquisition attempts (< renew deadline)",
        "SECONDS",
    ),
    Setting(
        "runtime-image",
        _text,
        lambda: DEFAULT_RUNTIME_IMAGE,
        DEFAULT_RUNTIME_IMAGE,
        "image for InferenceServices that set no spec.runtime.image",
        "IMAGE",
    ),
    Setting(
        "cluster-domain",
        _text,
        lambda: "cluster.local",
        "cluster.local",
        "the cluster's DNS suffix, for status.url",
    ),
    Setting(
        "gateway-url",
        _text,
        lambda: "",
        "each service's own URL",
        "the gateway's OpenAI base URL, written to every InferenceService's status.url",
        "URL",
    ),
    Setting(
        "default-gpu-resource",
        _text,
        lambda: "nvidia.com/gpu",
        "nvidia.com/gpu",
        "GPU resource name for InferenceServices without a gpuPool",
    ),
    Setting(
        "config-map-threshold-bytes",
        _number(int, "a whole number of bytes", 0),
        lambda: 256,
        "256",
        "engine flags longer than this move from the pod's args into a ConfigMap",
        "BYTES",
    ),
    Setting(
        "workers",
        _number(int, "a whole number", 1),
        lambda: 32,
        "32",
        "concurrent reconciles (a quarter of them wait for spec changes only)",
        "N",
    ),
    Setting(
        "resync-seconds",
        _number(float, "a number of seconds", 1),
        lambda: 600.0,
        "600",
        "how often everything is listed and reconciled again besides watch events",
        "SECONDS",
    ),
    Setting(
        "log-level",
        _level,
        lambda: "info",
        "info",
        f"one of {', '.join(LOG_LEVELS)} (any case)",
        "LEVEL",
    ),
)


def _checked(setting: Setting) -> Callable[[str], Any]:
    """The setting's parser, as an argparse type (its errors become usage errors)."""

    def parse(text: str) -> Any:
        try:
            return setting.parse(text)
        except SettingError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    parse.__name__ = setting.flag
    return parse


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "operator",
        help="run the Kubernetes operator (InferenceService and GPUPool)",
        description="Reconcile InferenceServices and GPUPools. Every flag can also be set as "
        "an environment variable named LADLE_OPERATOR_ and the flag in upper case with "
        "dashes as underscores (--lease-namespace: LADLE_OPERATOR_LEASE_NAMESPACE); the "
        "command line wins.",
    )
    for setting in SETTINGS:
        help_text = f"{setting.help} (default: {setting.shown}; env {env_name(setting.flag)})"
        if setting.parse is parse_bool:
            parser.add_argument(
                f"--{setting.flag}",
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                f"--{setting.flag}",
                type=_checked(setting),
                default=None,
                metavar=setting.metavar or setting.dest.upper(),
                help=help_text,
            )
    parser.set_defaults(func=_run)


def resolve(args: argparse.Namespace, environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Each setting from the command line, else its variable, else its default."""
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for setting in SETTINGS:
        given = getattr(args, setting.dest, None)
        if given is not None:
            values[setting.dest] = given
            continue
        raw = env.get(env_name(setting.flag))
        if raw is None:
            values[setting.dest] = setting.default()
            continue
        try:
            values[setting.dest] = setting.parse(raw)
        except SettingError as err:
            raise SettingError(f"{env_name(setting.flag)}={raw!r}: {err}") from None
    return values


def _run(args: argparse.Namespace) -> int:
    from ladle.operator.config import OperatorConfig
    from ladle.operator.leader import ElectionTiming

    try:
        values = resolve(args)
        timing = ElectionTiming(
            values["lease_duration"], values["renew_deadline"], values["retry_period"]
        )
    except (SettingError, ValueError) as err:
        print(f"ladle operator: {err}", file=sys.stderr)
        return 2

    from ladle.operator.main import Options, run

    host, port = values["metrics_bind_address"]
    return run(
        Options(
            config=OperatorConfig(
                runtime_image=values["runtime_image"],
                cluster_domain=values["cluster_domain"],
                gateway_url=values["gateway_url"] or None,
                default_gpu_resource=values["default_gpu_resource"],
                config_map_threshold_bytes=values["config_map_threshold_bytes"],
            ),
            metrics_host=host,
            metrics_port=port,
            leader_elect=values["leader_elect"],
            lease_namespace=values["lease_namespace"],
            lease_name=values["lease_name"],
            identity=values["identity"],
            timing=timing,
            workers=values["workers"],
            resync_seconds=values["resync_seconds"],
            log_level=values["log_level"],
        )
    )
