"""Flow control on the data path, over real sockets against fake pods that count their slots:
late binding, priority bands with shedding, fair shares between tenants, and a client that
leaves the queue."""

from __future__ import annotations

import asyncio
import inspect
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from ladle.operator.load import GatewayLoad
from ladle.operator.scrape import parse_gateway
from ladle.runtime_metrics import RUNNING, samples

from .conftest import SERVE_FLAGS, free_port, start_ladle

pytestmark = pytest.mark.timeout(60)

PREEMPTIONS = "ladle:num_preemptions_total"
# A wait's bound: beside the other worker's tests a 10 ms poll can run far less often.
WAIT_SECONDS = 20.0


def service(pod: Any, slots: int, **extra: Any) -> dict[str, Any]:
    return {
        "name": "chat",
        "model": "m",
        "endpoints": [pod.url],
        "routing": {"maxConcurrency": slots},
        **extra,
    }


async def post(
    client: httpx.AsyncClient, url: str, rid: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    return await client.post(
        url + "/v1/completions",
        json={"model": "m", "prompt": "x", "max_tokens": 8},
        headers={"x-request-id": rid, **(headers or {})},
    )


async def until(check: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    """Poll ``check`` until it holds, or fail naming ``what`` never happened."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        found = check()
        if await found if inspect.isawaitable(found) else found:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {WAIT_SECONDS:g} s")
        await asyncio.sleep(0.01)


async def queued(gateway: Any, count: int) -> None:
    """Until ``count`` requests wait in the service's queue."""
    state = gateway.cluster.states[("default", "chat")]
    await until(lambda: len(state.queue) == count, f"{count} requests queued")


async def held_by(url: str, count: int) -> None:
    """Until a gateway process holds ``count`` requests (its held gauge, summed over bands)."""
    async with httpx.AsyncClient(timeout=5) as client:

        async def holds() -> bool:
            page = (await client.get(url + "/metrics")).text
            found = samples(page, ("ladle_gateway_held_requests",))["ladle_gateway_held_requests"]
            return sum(v for _, v in found) == count

        await until(holds, f"the gateway holding {count} requests")


async def test_late_binding_keeps_the_pods_own_queue_empty(
    fake_pods: Any, run_gateway: Any
) -> None:
    pods = [await fake_pods(delay=0.2, slots=2) for _ in range(2)]
    gw = await run_gateway(
        [{"name": "chat", "model": "m", "endpoints": [p.url for p in pods],
          "routing": {"maxConcurrency": 2}}]
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(*(post(client, gw.url, f"r{i}") for i in range(12)))
    assert [r.status_code for r in answers] == [200] * 12
    assert [p.peak_waiting for p in pods] == [0, 0]  # 3x the slots, and no pod queued one
    assert sum(len(p.seen) for p in pods) == 12
    waited = gw.gateway.metrics.registry.get_sample_value(
        "ladle_gateway_queued_total",
        {"namespace": "default", "service": "chat", "band": "standard", "tenant": ""},
    )
    assert waited == 8


async def test_the_gateway_times_a_slot_for_the_autoscaler(
    fake_pods: Any, run_gateway: Any
) -> None:
    """Untimed, the service has no slot time on the page (the autoscaler then counts each held
    request as one); once requests have held a slot, the time the autoscaler reads from the
    gateway's own page is theirs. Its count of the requests that asked for a slot is there
    too."""
    pod = await fake_pods(delay=0.3, slots=1)
    gw = await run_gateway([service(pod, 1)])
    async with httpx.AsyncClient(timeout=30) as client:
        before = (await client.get(gw.url + "/metrics")).text
        answers = await asyncio.gather(*(post(client, gw.url, f"r{i}") for i in range(3)))
        after = (await client.get(gw.url + "/metrics")).text
    assert [r.status_code for r in answers] == [200] * 3
    assert parse_gateway(before, "default", "chat", "gw") == GatewayLoad(arrivals={"gw": 0})
    read = parse_gateway(after, "default", "chat", "gw")
    assert (read.in_flight, read.held, read.arrivals) == (0, 0, {"gw": 3})
    assert read.slot_seconds is not None
    assert 0.3 <= read.slot_seconds < 1.0


async def test_early_binding_when_concurrency_is_zero(fake_pods: Any, run_gateway: Any) -> None:
    pod = await fake_pods(delay=0.2, slots=2)
    gw = await run_gateway([service(pod, 0)])
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(*(post(client, gw.url, f"r{i}") for i in range(6)))
    assert [r.status_code for r in answers] == [200] * 6
    assert pod.peak_waiting == 4  # every request went to the pod on arrival


async def test_a_higher_band_goes_first_and_only_the_lowest_is_shed(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(delay=0.3, slots=1)
    gw = await run_gateway([service(pod, 1)], max_held_requests=3)
    low = {"x-ladle-priority": "sheddable"}
    async with httpx.AsyncClient(timeout=30) as client:
        first = asyncio.ensure_future(post(client, gw.url, "busy", low))
        await asyncio.sleep(0.1)
        lows = [asyncio.ensure_future(post(client, gw.url, f"low{i}", low)) for i in range(3)]
        await queued(gw.gateway, 3)
        refused = await post(client, gw.url, "low-refused", low)
        high = asyncio.ensure_future(post(client, gw.url, "high", {"x-ladle-priority": "critical"}))
        answers = await asyncio.gather(first, high, *lows)
    # The queue was full of the lowest band: a newcomer of that band is refused, and a higher
    # one takes the place of the last sheddable request in line.
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "queue_full"
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    statuses = [r.status_code for r in answers]
    assert statuses == [200, 200, 200, 200, 429]
    assert "sheddable" in answers[-1].json()["error"]["message"]
    assert pod.order == ["busy", "high", "low0", "low1"]
    shed = gw.gateway.metrics.registry.get_sample_value(
        "ladle_gateway_shed_total",
        {"namespace": "default", "service": "chat", "band": "sheddable", "reason": "displaced"},
    )
    assert shed == 1


async def test_within_a_band_the_earliest_deadline_goes_first(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(delay=0.2, slots=1)
    gw = await run_gateway([service(pod, 1)])
    async with httpx.AsyncClient(timeout=30) as client:
        first = asyncio.ensure_future(post(client, gw.url, "busy"))
        await asyncio.sleep(0.05)
        late = asyncio.ensure_future(post(client, gw.url, "late", {"x-ladle-timeout": "30"}))
        await queued(gw.gateway, 1)
        soon = asyncio.ensure_future(post(client, gw.url, "soon", {"x-ladle-timeout": "10"}))
        await asyncio.gather(first, late, soon)
    assert pod.order == ["busy", "soon", "late"]


async def test_a_light_tenant_is_not_starved_by_a_heavy_one(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(delay=0.05, slots=1)
    gw = await run_gateway([service(pod, 1)])
    heavy = {"x-gateway-inference-fairness-id": "heavy"}
    light = {"x-gateway-inference-fairness-id": "light"}
    async with httpx.AsyncClient(timeout=30) as client:
        flood = [asyncio.ensure_future(post(client, gw.url, f"h{i}", heavy)) for i in range(10)]
        await queued(gw.gateway, 9)
        mine = [asyncio.ensure_future(post(client, gw.url, f"l{i}", light)) for i in range(2)]
        await asyncio.gather(*flood, *mine)
    # In first come, first served, the light tenant would wait behind all ten. With fair
    # shares it is lifted to the heavy tenant's count on arrival and alternates with it.
    assert pod.order.index("l0") <= 2
    assert pod.order.index("l1") <= 4


async def test_a_client_that_leaves_the_queue_frees_its_place(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(delay=0.3, slots=1)
    gw = await run_gateway([service(pod, 1)], max_held_requests=1)
    async with httpx.AsyncClient(timeout=30) as client:
        first = asyncio.ensure_future(post(client, gw.url, "busy"))
        await asyncio.sleep(0.05)
        async with httpx.AsyncClient(timeout=30) as leaving:
            gone = asyncio.ensure_future(post(leaving, gw.url, "gone"))
            await queued(gw.gateway, 1)
            gone.cancel()
        await queued(gw.gateway, 0)
        after = await post(client, gw.url, "after")
        assert (await first).status_code == 200
    assert after.status_code == 200
    assert pod.order == ["busy", "after"]


async def test_bands_are_checked_and_keys_cap_them(
    fake_pods: Any, run_gateway: Any, tmp_path: Path
) -> None:
    pod = await fake_pods()
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "keys:\n  - {name: batch, key: sk-batch-0001, priority: sheddable}\n"
        "  - {name: ops, key: sk-ops-00001}\n"
    )
    gw = await run_gateway([service(pod, 4)], api_keys_file=keys)
    batch = {"authorization": "Bearer sk-batch-0001"}
    async with httpx.AsyncClient(timeout=30) as client:
        unknown = await post(client, gw.url, "a", {**batch, "x-ladle-priority": "urgent"})
        above = await post(client, gw.url, "b", {**batch, "x-ladle-priority": "critical"})
        own = await post(client, gw.url, "c", batch)
        ops = await post(
            client,
            gw.url,
            "d",
            {"authorization": "Bearer sk-ops-00001", "x-ladle-priority": "critical"},
        )
    assert unknown.status_code == 400
    assert unknown.json()["error"]["message"] == (
        "x-ladle-priority names no band: 'urgent'; the bands are critical, standard, sheddable "
        "(highest first)"
    )
    assert above.status_code == 403
    assert "'sheddable' or a lower band" in above.json()["error"]["message"]
    assert own.status_code == 200
    assert ops.status_code == 200
    assert len(pod.seen) == 2


async def test_two_gateways_share_a_pods_slots_by_its_own_counts(
    fake_pods: Any, run_gateway: Any
) -> None:
    """Each replica counts its own requests exactly and the other's from the pod's page: while
    the first fills the pod, the second holds its requests instead of queueing them in the pod,
    and sends them as the pod's own count shows slots free. (Two replicas that both hold
    requests can fill one freed slot twice within a scrape interval; docs/gateway.md.)"""
    pod = await fake_pods(delay=0.5, slots=2)
    first = await run_gateway([service(pod, 2)], scrape_interval=0.05)
    second = await run_gateway([service(pod, 2)], scrape_interval=0.05)
    async with httpx.AsyncClient(timeout=30) as client:
        mine = [asyncio.ensure_future(post(client, first.url, f"a{i}")) for i in range(2)]
        await until(
            lambda: any(load.others >= 2 for load in second.gateway.scraper.loads.values()),
            "a scrape showing the second gateway that the pod is full",
        )
        theirs = [asyncio.ensure_future(post(client, second.url, f"b{i}")) for i in range(4)]
        await queued(second.gateway, 4)
        answers = await asyncio.gather(*mine, *theirs)
    assert [r.status_code for r in answers] == [200] * 6
    assert pod.peak_waiting == 0
    assert pod.order[:2] in (["a0", "a1"], ["a1", "a0"])


@pytest.mark.parametrize(
    ("drain", "delay", "answered"), [(10, 0.5, True), (1, 3.0, False)], ids=["drained", "cut"]
)
async def test_a_stopping_gateway_answers_or_fails_what_it_holds(
    fake_pods: Any, tmp_path: Path, drain: int, delay: float, answered: bool
) -> None:
    """SIGTERM with requests held: within the drain timeout they are still bound and answered;
    past it, each client gets a 503 to retry elsewhere. None is left hanging."""
    pod = await fake_pods(delay=delay, slots=1)
    routes = tmp_path / "routes.yaml"
    routes.write_text(yaml.safe_dump({"services": [service(pod, 1)]}))
    port = free_port()
    gw = await asyncio.to_thread(
        start_ladle, tmp_path / "gateway.log", "gateway", "--static", str(routes),
        "--port", str(port), "--scrape-interval", "0", "--drain-timeout", str(drain), port=port,
    )  # fmt: skip
    try:
        async with httpx.AsyncClient(timeout=30) as client:
            sent = [asyncio.ensure_future(post(client, gw.url, "r0"))]
            await until(lambda: bool(pod.order), "the first request at the pod")
            for i in (1, 2):  # then two held at the gateway, in order
                sent.append(asyncio.ensure_future(post(client, gw.url, f"r{i}")))
                await held_by(gw.url, i)
            gw.proc.send_signal(signal.SIGTERM)
            done = await asyncio.wait_for(asyncio.gather(*sent, return_exceptions=True), drain + 10)
    finally:
        gw.stop()
    if answered:
        assert [getattr(r, "status_code", r) for r in done] == [200, 200, 200]
        assert pod.order == ["r0", "r1", "r2"]
    else:  # the one at the pod and the two held get a 503 that says to retry
        assert [getattr(r, "status_code", r) for r in done] == [503, 503, 503]
        assert all(r.json()["error"]["code"] == "shutting_down" for r in done)
        assert all(r.headers["retry-after"] == "1" for r in done)
        assert pod.order == ["r0"]


async def test_a_services_queue_series_start_at_zero(fake_pods: Any, run_gateway: Any) -> None:
    """Dashboards and recording rules read 0, not no data, for a queue never used."""
    pod = await fake_pods()
    gw = await run_gateway([service(pod, 4)])
    registry = gw.gateway.metrics.registry
    where = {"namespace": "default", "service": "chat"}
    for band in ("critical", "standard", "sheddable"):
        held = registry.get_sample_value("ladle_gateway_held_requests", {**where, "band": band})
        assert held == 0
        for reason in ("queue_full", "displaced", "deadline", "no_ready_pods"):
            labels = {**where, "band": band, "reason": reason}
            assert registry.get_sample_value("ladle_gateway_shed_total", labels) == 0


HEAVY = {"x-gateway-inference-fairness-id": "heavy"}
LIGHT = {"x-gateway-inference-fairness-id": "light"}


@pytest.fixture(scope="module", params=["priority", "fcfs"])
def one_slot_pod(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Any]]:
    """A real engine with one slot, ordering by ``priority`` or first come first served (one
    for bands and tenants alike)."""
    port = free_port()
    log = tmp_path_factory.mktemp(f"one-slot-{request.param}") / "serve.log"
    flags = ("--max-num-seqs", "1", "--scheduling-policy", request.param)
    pod = start_ladle(
        log, "serve", "--port", str(port), "--served-model-name", "m", *SERVE_FLAGS, *flags,
        port=port,
    )  # fmt: skip
    yield request.param, pod
    pod.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("low", "high"),
    [({"x-ladle-priority": "sheddable"}, {"x-ladle-priority": "critical"}), (HEAVY, LIGHT)],
    ids=["bands", "tenants"],
)
async def test_a_higher_level_displaces_a_lower_one_where_the_engine_orders_by_priority(
    run_gateway: Any, one_slot_pod: Any, low: dict[str, str], high: dict[str, str]
) -> None:
    """One slot, on a real engine. Ordering by priority, a critical request that arrives while
    a sheddable one runs is bound at once, beyond the slot, with its band as vLLM's
    ``priority``: the engine preempts the sheddable one, and the critical one is answered
    first. So does a light tenant's request beside a heavy tenant's in the same band (the light
    one is under its fair share of the slot, the heavy one, alone when it came, is not). The
    displaced one still finishes in full. Under fcfs (a static endpoint's default) the
    newcomer waits at the gateway for the slot instead."""
    policy, pod = one_slot_pod
    engine = {"engine": {"schedulingPolicy": "priority"}} if policy == "priority" else {}
    # The displaced request's whole answer is its first byte (it does not stream): on a loaded
    # machine, 160 tokens after a preemption can outlast the default 60 s.
    timeouts = {"timeouts": {"firstTokenSeconds": 200}}
    gw = await run_gateway([service(pod, 1, **engine, **timeouts)])
    body = {"model": "m", "prompt": "Count to a hundred:", "ignore_eos": True}
    async with httpx.AsyncClient(timeout=210) as client:
        page = (await client.get(pod.url + "/metrics")).text
        preempted_before = sum(v for _, v in samples(page, (PREEMPTIONS,))[PREEMPTIONS])
        low = asyncio.ensure_future(
            client.post(
                gw.url + "/v1/completions",
                json={**body, "max_tokens": 160},
                headers=low,
            )
        )

        async def running() -> bool:
            page = (await client.get(pod.url + "/metrics")).text
            return sum(v for _, v in samples(page, (RUNNING,))[RUNNING]) == 1

        await until(running, "the first request running on the pod")
        high = await client.post(
            gw.url + "/v1/completions",
            json={**body, "max_tokens": 4},
            headers=high,
        )
        first = not low.done()
        low_answer = await low
        page = (await client.get(pod.url + "/metrics")).text
    assert (high.status_code, low_answer.status_code) == (200, 200)
    assert low_answer.json()["usage"]["completion_tokens"] == 160
    preempted = sum(v for _, v in samples(page, (PREEMPTIONS,))[PREEMPTIONS]) - preempted_before
    if policy == "priority":
        assert first, "the newcomer waited for the running request"
        assert preempted >= 1
    else:
        assert not first, "the newcomer overtook a running request under fcfs"
        assert preempted == 0


async def test_the_band_reaches_the_engine_as_its_priority_and_a_clients_own_does_not(
    fake_pods: Any, run_gateway: Any
) -> None:
    """Ordering by priority, the engine's ``priority`` is two steps a band from the default
    band (no field for the default itself; the step between is a tenant under its fair share),
    whatever the client wrote there: its own would jump its band. Under fcfs the body goes as
    it came."""
    ordered, plain = await fake_pods(), await fake_pods()
    gw = await run_gateway(
        [
            {**service(ordered, 4), "engine": {"schedulingPolicy": "priority"}},
            {**service(plain, 4), "name": "plain", "model": "p"},
        ]
    )
    cases = [("critical", -2), ("standard", None), ("sheddable", 2)]
    async with httpx.AsyncClient(timeout=30) as client:
        for band, _ in cases:
            answer = await client.post(
                gw.url + "/v1/completions",
                json={"model": "m", "prompt": "x", "max_tokens": 1, "priority": -5},
                headers={"x-ladle-priority": band},
            )
            assert answer.status_code == 200
        answer = await client.post(
            gw.url + "/v1/completions",
            json={"model": "p", "prompt": "x", "max_tokens": 1, "priority": -5},
            headers={"x-ladle-priority": "sheddable"},
        )
        assert answer.status_code == 200
    assert [seen.body.get("priority") for seen in ordered.seen] == [p for _, p in cases]
    assert plain.seen[-1].body["priority"] == -5
