"""Plain Prometheus configuration from the chart's monitoring objects.

A Prometheus without the Prometheus operator cannot read PodMonitors and PrometheusRules, so
``scrape_configs`` turns each PodMonitor endpoint into the scrape config the operator would
generate for it (``generatePodMonitorConfig`` in prometheus-operator's pkg/prometheus/promcfg.go:
pod discovery, the running-pod filter, a keep per selector label, the port filter, the
namespace/container/pod/job/endpoint labels, then the monitor's own relabelings), and
``rule_groups`` takes a PrometheusRule's groups as a rule file. The same functions write
manifests/prometheus/ and configure the real Prometheus of the end-to-end test.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

JSON = dict[str, Any]


def _label(name: str) -> str:
    """Kubernetes label name → Prometheus meta label suffix (prometheus-operator's rule)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _relabeling(item: Mapping[str, Any]) -> JSON:
    """A monitoring.coreos.com RelabelConfig (camelCase) as Prometheus's relabel_config."""
    keys = {
        "sourceLabels": "source_labels",
        "targetLabel": "target_label",
        "separator": "separator",
        "regex": "regex",
        "modulus": "modulus",
        "replacement": "replacement",
        "action": "action",
    }
    return {keys[k]: v for k, v in item.items() if k in keys}


def _namespaces(monitor: Mapping[str, Any]) -> list[str] | None:
    """None for every namespace; a PodMonitor without a selector watches its own namespace."""
    selector = monitor["spec"].get("namespaceSelector") or {}
    if selector.get("any"):
        return None
    return list(selector.get("matchNames") or [monitor["metadata"]["namespace"]])


def scrape_configs(
    monitors: Iterable[Mapping[str, Any]],
    *,
    kubeconfig: str | None = None,
    interval: str | None = None,
) -> list[JSON]:
    """Scrape configs for PodMonitors; ``kubeconfig`` points discovery at a cluster from outside
    it, ``interval`` overrides every endpoint's."""
    out: list[JSON] = []
    for monitor in monitors:
        if monitor.get("kind") != "PodMonitor":
            raise ValueError(f"only PodMonitors convert, not {monitor.get('kind')}")
        meta, spec = monitor["metadata"], monitor["spec"]
        sd: JSON = {"role": "pod"}
        namespaces = _namespaces(monitor)
        if namespaces is not None:
            sd["namespaces"] = {"names": namespaces}
        if kubeconfig:
            sd["kubeconfig_file"] = kubeconfig
        match = (spec.get("selector") or {}).get("matchLabels") or {}
        if set(spec.get("selector") or {}) - {"matchLabels"}:
            raise ValueError(f"PodMonitor {meta['name']}: only selector.matchLabels converts")
        for index, endpoint in enumerate(spec.get("podMetricsEndpoints") or ()):
            port = endpoint["port"]
            relabel: list[JSON] = [
                {
                    "action": "drop",
                    "source_labels": ["__meta_kubernetes_pod_phase"],
                    "regex": "(Failed|Succeeded)",
                },
                *(
                    {
                        "action": "keep",
                        "source_labels": [
                            f"__meta_kubernetes_pod_label_{_label(key)}",
                            f"__meta_kubernetes_pod_labelpresent_{_label(key)}",
                        ],
                        "regex": f"({value});true",
                    }
                    for key, value in sorted(match.items())
                ),
                {
                    "action": "keep",
                    "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                    "regex": port,
                },
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {
                    "source_labels": ["__meta_kubernetes_pod_container_name"],
                    "target_label": "container",
                },
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"target_label": "job", "replacement": f"{meta['namespace']}/{meta['name']}"},
                {"target_label": "endpoint", "replacement": port},
                *(_relabeling(r) for r in endpoint.get("relabelings") or ()),
            ]
            config: JSON = {
                "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{index}",
                "honor_labels": bool(endpoint.get("honorLabels", False)),
                "kubernetes_sd_configs": [sd],
                "metrics_path": endpoint.get("path", "/metrics"),
            }
            if interval or endpoint.get("interval"):
                config["scrape_interval"] = interval or endpoint["interval"]
            config["relabel_configs"] = relabel
            out.append(config)
    return out


def rule_groups(prometheus_rule: Mapping[str, Any]) -> JSON:
    """A PrometheusRule's groups as a Prometheus rule file."""
    if prometheus_rule.get("kind") != "PrometheusRule":
        raise ValueError(f"expected a PrometheusRule, not {prometheus_rule.get('kind')}")
    return {"groups": list(prometheus_rule["spec"]["groups"])}
