"""Routes from a YAML file instead of Kubernetes: the gateway in front of ``ladle serve``
processes anywhere (and what the benchmark runs). Each entry reads like an InferenceService::

    services:
      - name: chat
        model: smollm2
        endpoints: [http://127.0.0.1:8001, http://127.0.0.1:8002]   # the stable variant
        fallback: backup                  # optional, another entry's name
        routing: {prefixChars: 200}       # optional: spec.routing, circuitBreaker, timeouts,
        responseCache: {enabled: true}    #   responseCache, engine
        engine: {schedulingPolicy: priority}  # what the endpoints run: fcfs unless said
        adapters: [sql, fr]               # optional: LoRA adapters the endpoints serve
      - name: backup
        model: smollm2-int8
        variants:                         # instead of endpoints: a canary split
          stable: {weight: 90, endpoints: [http://127.0.0.1:8003]}
          canary: {weight: 10, endpoints: [http://127.0.0.1:8004]}

Static pods are always considered ready; outlier ejection takes dead ones out of rotation.
"""

from __future__ import annotations

import difflib
import urllib.parse
from pathlib import Path
from typing import Any

import yaml

from ladle.api import STABLE
from ladle.flag_types import yaml_problem
from ladle.gateway.routes import Pod, Service, parse_service

_SPEC_KEYS = ("fallback", "routing", "circuitBreaker", "timeouts", "responseCache", "engine")
_ENTRY_KEYS = ("name", "model", "namespace", "endpoints", "variants", "adapters", *_SPEC_KEYS)


class StaticConfigError(ValueError):
    pass


def _endpoint(url: Any, where: str) -> tuple[str, int]:
    parsed = urllib.parse.urlsplit(str(url))
    if parsed.scheme != "http" or not parsed.hostname:
        raise StaticConfigError(f"{where}: expected http://HOST:PORT, got {url!r}")
    return parsed.hostname, parsed.port or 80


def _variants(entry: dict[str, Any]) -> dict[str, tuple[int, list[Any]]]:
    if "variants" in entry:
        return {
            str(v): (int(spec.get("weight", 0)), list(spec.get("endpoints") or ()))
            for v, spec in dict(entry["variants"]).items()
        }
    endpoints = entry.get("endpoints") or ()
    if isinstance(endpoints, str):
        raise TypeError("a string where a list belongs")
    return {STABLE: (100, list(endpoints))}


def _adapters(names: Any, where: str) -> dict[str, Any]:
    """spec.adapters for the names an entry lists (their folders are the endpoints' own)."""
    if names is None:
        return {}
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise StaticConfigError(f"{where}.adapters: expected a list of adapter names")
    return {"adapters": [{"name": n, "source": {"image": {"path": "/"}}} for n in names]}


def load_static(path: Path) -> tuple[list[Service], list[Pod]]:
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise StaticConfigError(f"{path}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise StaticConfigError(f"{path}: {yaml_problem(exc)}") from None
    entries = doc.get("services") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise StaticConfigError(f"{path}: expected a mapping with a non-empty 'services' list")
    services: list[Service] = []
    pods: list[Pod] = []
    for i, entry in enumerate(entries):
        where = f"{path}: services[{i}]"
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("model"):
            raise StaticConfigError(f"{where}: name and model are required")
        for key in entry:
            if key not in _ENTRY_KEYS:
                close = difflib.get_close_matches(str(key), _ENTRY_KEYS, n=1)
                hint = (
                    f"did you mean {close[0]!r}?" if close else f"known: {', '.join(_ENTRY_KEYS)}"
                )
                raise StaticConfigError(f"{where}: unknown key {key!r}; {hint}")
        namespace = str(entry.get("namespace") or "default")
        name = str(entry["name"])
        try:
            variants = _variants(entry)
        except (TypeError, ValueError, AttributeError):
            raise StaticConfigError(
                f"{where}: expected endpoints: [http://HOST:PORT, ...], or variants: "
                "{NAME: {weight: N, endpoints: [...]}}"
            ) from None
        if "endpoints" not in entry and "variants" not in entry:
            # An explicit empty list is a service scaled to zero; no list at all is a mistake.
            raise StaticConfigError(f"{where}: endpoints (or variants) is required")
        count = 0
        for variant, (_, urls) in variants.items():
            for j, url in enumerate(urls):
                host, port = _endpoint(url, f"{where}.{variant}[{j}]")
                pods.append(
                    Pod(namespace, f"{name}-{variant}-{j}", name, variant, host, port, True)
                )
                count += 1
        obj = {
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "model": {"name": str(entry["model"])},
                "replicas": count,
                **{k: entry[k] for k in _SPEC_KEYS if k in entry},
                # ``ladle serve``'s own default, unlike an InferenceService's pods.
                "engine": {"schedulingPolicy": "fcfs", **(entry.get("engine") or {})},
                **_adapters(entry.get("adapters"), where),
            },
            "status": {
                "rollout": {
                    "weights": [{"variant": v, "weight": w} for v, (w, _) in variants.items()]
                },
                # What the endpoints run is not known here, and the file is read once: one
                # revision per variant for the process's life keys the response cache.
                "variants": [{"name": v, "revision": "static"} for v in variants],
            },
        }
        try:
            services.append(parse_service(obj))
        except (TypeError, ValueError) as exc:
            raise StaticConfigError(f"{where}: {exc}") from None
    return services, pods
