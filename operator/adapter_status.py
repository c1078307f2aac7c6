"""What each runtime pod serves of ``spec.adapters``, as status says it: the adapters every
pod has loaded (``status.adapters``), and the ``AdaptersReady`` condition, which names an
adapter a pod cannot serve (a rank above ``maxLoraRank``, a missing file, an adapter made for
another base model) with the runtime's own words.

The pods load adapters on their own, from the ConfigMap they follow, and nothing about a pod
changes when one fails: so the reconciler asks each ready pod (``GET /v1/lora_adapters``), and
asks again soon while the pods have not caught up with the spec. Reading is thin I/O here;
``observe`` is a pure function of what the pods answered.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ladle.api import JSON
from ladle.operator.conditions import ADAPTERS_READY, Condition
from ladle.operator.store import PodInfo
from ladle.words import plural

log = logging.getLogger("ladle.operator.adapters")

READ_TIMEOUT_SECONDS = 3.0
# Ask again this soon while the pods are still loading what the spec lists (the kubelet
# refreshes their ConfigMap within a minute), or after a pod did not answer.
CATCHING_UP_SECONDS = 5.0
# And this often once they serve it, to see a pod that lost an adapter (or was replaced by
# one that cannot load it) without a pod event to say so.
SETTLED_SECONDS = 30.0


@dataclass(frozen=True)
class PodAdapters:
    """One pod's answer: what it serves and what it cannot (name -> why), or why it did not
    answer."""

    pod: str
    variant: str
    loaded: tuple[str, ...] = ()
    failed: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class AdaptersObservation:
    """``status.adapters``, the condition, and when to ask again."""

    pods: tuple[PodAdapters, ...]
    condition: Condition
    recheck_in: float

    def status(self) -> list[JSON]:
        out: list[JSON] = []
        for p in self.pods:
            entry: JSON = {"pod": p.pod, "variant": p.variant, "loaded": list(p.loaded)}
            if p.failed:
                entry["failed"] = [{"name": n, "message": m} for n, m in sorted(p.failed.items())]
            if p.error is not None:
                entry["error"] = p.error
            out.append(entry)
        return out


def parse_report(pod: str, variant: str, body: Any) -> PodAdapters:
    """A pod's ``GET /v1/lora_adapters``; an answer of another shape is an error."""
    try:
        loaded = tuple(sorted(str(a["name"]) for a in body["loaded"]))
        failed = {str(a["name"]): str(a["error"]) for a in body["failed"]}
    except (KeyError, TypeError) as err:
        return PodAdapters(pod, variant, error=f"unreadable answer: {err!r}")
    return PodAdapters(pod, variant, loaded, failed)


def observe(
    wanted: Mapping[str, Sequence[str]], pods: Sequence[PodAdapters]
) -> AdaptersObservation:
    """The condition over what the pods answered; ``wanted``: each variant's adapter names.

    A failure is the reason whatever else holds (it will not mend by itself); then an adapter
    some pod does not serve yet; a pod that did not answer says nothing either way."""
    answered = [p for p in pods if p.error is None]
    failures = sorted((name, p.pod, why) for p in answered for name, why in p.failed.items())
    if failures:
        named: dict[str, str] = {}
        for name, pod, why in failures:
            named.setdefault(name, f"{name} on {pod}: {why}")
        condition = Condition(ADAPTERS_READY, False, "AdapterLoadFailed", "; ".join(named.values()))
        return AdaptersObservation(tuple(pods), condition, CATCHING_UP_SECONDS)
    missing: dict[str, int] = {}
    for p in answered:
        for name in wanted.get(p.variant, ()):
            if name not in p.loaded:
                missing[name] = missing.get(name, 0) + 1
    silent = len(pods) - len(answered)
    if missing:
        words = [f"{n}: loading on {plural(k, 'pod')}" for n, k in sorted(missing.items())]
        condition = Condition(ADAPTERS_READY, False, "Loading", "; ".join(words))
    elif not answered:
        why = "no ready pod to ask" if not pods else f"no pod answered ({pods[0].error})"
        condition = Condition(ADAPTERS_READY, True, "NoPodAnswered", why)
    else:
        count = len({n for names in wanted.values() for n in names})
        message = f"every ready pod serves its {plural(count, 'adapter')}"
        if silent:
            message += f" ({plural(silent, 'pod')} did not answer)"
        condition = Condition(ADAPTERS_READY, True, "Loaded", message)
    settled = not missing and not silent and bool(answered)
    return AdaptersObservation(
        tuple(pods), condition, SETTLED_SECONDS if settled else CATCHING_UP_SECONDS
    )


async def read_pods(pods: Sequence[PodInfo]) -> list[PodAdapters]:
    """Every ready pod's answer, at once."""

    async def one(http: httpx.AsyncClient, pod: PodInfo) -> PodAdapters:
        try:
            response = await http.get(f"{pod.base_url}/v1/lora_adapters")
            response.raise_for_status()
            return parse_report(pod.name, pod.variant, response.json())
        except (httpx.HTTPError, ValueError) as err:
            log.info("could not read a pod's adapters", extra={"pod": pod.name, "error": str(err)})
            return PodAdapters(pod.name, pod.variant, error=str(err) or type(err).__name__)

    async with httpx.AsyncClient(timeout=READ_TIMEOUT_SECONDS) as http:
        return list(await asyncio.gather(*(one(http, p) for p in pods if p.base_url)))
