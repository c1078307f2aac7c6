"""Reading the load signals the autoscaler decides on, straight from the pods' /metrics.

The autoscaler reads the runtime pods and the gateway replicas itself, every tick, as Knative's
autoscaler reads its queue-proxies: a Prometheus server and an adapter in between would add
their scrape interval and rate windows to every reaction. Parsing is pure (text in, numbers
out); fetching is a thin aiohttp GET with a short timeout, and every way it can fail becomes an
error string that the decision treats as unknown data, never as zero load.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import aiohttp

from ladle.operator.load import GatewayLoad, PodLoad
from ladle.runtime_metrics import ITL, KV_USAGE, RUNNING, WAITING, samples

GATEWAY_IN_FLIGHT = "ladle_gateway_in_flight_requests"
GATEWAY_HELD = "ladle_gateway_held_requests"
GATEWAY_SLOT = "ladle_gateway_slot_seconds"
GATEWAY_ARRIVALS = "ladle_gateway_arrivals_total"
SCRAPE_TIMEOUT_SECONDS = 1.0


@dataclass(frozen=True)
class Target:
    name: str
    url: str  # the full /metrics URL


def parse_pod(name: str, text: str) -> PodLoad:
    """One runtime pod's gauges; a missing gauge is an error, not a zero. The inter-token
    histogram's totals are for the pace, and a runtime without them is only not paced."""
    try:
        found = samples(text, (RUNNING, WAITING, KV_USAGE, ITL + "_sum", ITL + "_count"))
    except ValueError as err:
        return PodLoad(name, error=f"unreadable metrics: {err}")
    totals = [found.pop(ITL + suffix) for suffix in ("_sum", "_count")]
    itl_sum, itl_count = (sum(v for _, v in t) if t else None for t in totals)
    missing = sorted(metric for metric, got in found.items() if not got)
    if missing:
        return PodLoad(name, error=f"metrics lack {', '.join(missing)}")
    running = sum(v for _, v in found[RUNNING])
    waiting = sum(v for _, v in found[WAITING])
    # One engine per pod; should a pod serve several models, the fullest cache speaks for it.
    kv_usage = max(v for _, v in found[KV_USAGE])
    return PodLoad(
        name,
        running=running,
        waiting=waiting,
        kv_usage=kv_usage,
        itl_sum=itl_sum,
        itl_count=itl_count,
    )


def parse_gateway(text: str, namespace: str, service: str, replica: str) -> GatewayLoad:
    """One service's counts from the exposition of the gateway replica ``replica``."""
    found = samples(text, (GATEWAY_IN_FLIGHT, GATEWAY_HELD, GATEWAY_SLOT, GATEWAY_ARRIVALS))

    def values(metric: str) -> list[float]:
        return [
            value
            for labels, value in found[metric]
            if labels.get("namespace") == namespace and labels.get("service") == service
        ]

    slot = values(GATEWAY_SLOT)
    return GatewayLoad(
        in_flight=sum(values(GATEWAY_IN_FLIGHT)),
        held=sum(values(GATEWAY_HELD)),
        slot_seconds=slot[0] if slot else None,
        arrivals={replica: sum(values(GATEWAY_ARRIVALS))},
    )


async def fetch(session: aiohttp.ClientSession, url: str) -> str:
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_SECONDS)
    async with session.get(url, timeout=timeout) as rsp:
        if rsp.status != 200:
            raise ValueError(f"HTTP {rsp.status}")
        return await rsp.text()


def _why(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return f"no answer within {SCRAPE_TIMEOUT_SECONDS:g} s"
    return str(err) or type(err).__name__


async def scrape_pods(session: aiohttp.ClientSession, pods: Sequence[Target]) -> list[PodLoad]:
    """Every ready pod at once; a pod that fails is reported with why."""

    async def one(pod: Target) -> PodLoad:
        try:
            return parse_pod(pod.name, await fetch(session, pod.url))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
            return PodLoad(pod.name, error=_why(err))

    return list(await asyncio.gather(*(one(p) for p in pods)))


async def scrape_gateways(
    session: aiohttp.ClientSession, gateways: Sequence[Target]
) -> dict[str, str | BaseException]:
    """Each gateway replica's exposition (or why it could not be read), to parse per service."""

    async def one(gateway: Target) -> str | BaseException:
        try:
            return await fetch(session, gateway.url)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
            return err

    texts = await asyncio.gather(*(one(g) for g in gateways))
    return {g.name: text for g, text in zip(gateways, texts, strict=True)}


def gateway_metrics(
    expositions: Mapping[str, str | BaseException], namespace: str, service: str
) -> GatewayLoad | None:
    """The gateways' counts for one service, summed over replicas (their arrivals kept by
    replica, whose counters restart apart), and the mean of their slot times (those that have
    timed one); None without gateways."""
    if not expositions:
        return None
    in_flight = held = 0.0
    arrivals: dict[str, float] = {}
    slots: list[float] = []
    for name, text in sorted(expositions.items()):
        if isinstance(text, BaseException):
            return GatewayLoad(error=f"gateway {name}: {_why(text)}")
        try:
            one = parse_gateway(text, namespace, service, name)
        except ValueError as err:
            return GatewayLoad(error=f"gateway {name}: unreadable metrics: {err}")
        in_flight += one.in_flight
        held += one.held
        arrivals.update(one.arrivals or {})
        if one.slot_seconds is not None:
            slots.append(one.slot_seconds)
    slot_seconds = statistics.fmean(slots) if slots else None
    return GatewayLoad(in_flight, held, slot_seconds=slot_seconds, arrivals=arrivals)
