"""Late binding on a real runtime pod: the chart's gateway holds what the pod's slots cannot
take, under `ladle bench serve`, while the pod's own engine never queues; and a higher
priority band displaces a lower one in the pod's engine.

The pod's engine runs 2 sequences at once (``maxNumSeqs``), which are its slots at the gateway
by default. The load keeps 6 requests in flight, three times that: binding late, the pod runs 2
and queues none, and the gateway holds the other 4 until a slot frees.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from ladle.runtime_metrics import RUNNING, WAITING, samples
from ladle_dev.pytest_plugin import wait_until

from .conftest import Load, System, cpu_service, wait_routed

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(600)]

NAME = "slots"
MODEL = "slots-model"
SLOTS = 2
CONCURRENCY = 3 * SLOTS
PREEMPTIONS = "ladle:num_preemptions_total"


def service() -> dict[str, Any]:
    return cpu_service(
        NAME, MODEL, engine={"kvCacheMemory": "64Mi", "maxModelLen": 512, "maxNumSeqs": SLOTS}
    )


class Sampler:
    """The pod's own running and waiting counts, and the gateway's held requests for the
    service, read every 0.2 s from their /metrics pages until stopped."""

    def __init__(self, pod_url: str, gateway_url: str) -> None:
        self.pod_url = pod_url
        self.gateway_url = gateway_url
        self.rows: list[tuple[float, float, float]] = []  # (running, waiting, held)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(0.2):
                pod = samples(client.get(self.pod_url).text, (RUNNING, WAITING))
                page = client.get(self.gateway_url + "/metrics").text
                held = samples(page, ("ladle_gateway_held_requests",))
                self.rows.append(
                    (
                        sum(v for _, v in pod[RUNNING]),
                        sum(v for _, v in pod[WAITING]),
                        sum(
                            v
                            for labels, v in held["ladle_gateway_held_requests"]
                            if labels.get("service") == NAME
                        ),
                    )
                )

    def stop(self) -> list[tuple[float, float, float]]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.rows


@pytest.fixture(scope="module")
def pod(ladle_system: System, gateway_url: str) -> Iterator[dict[str, Any]]:
    """The service's one Ready pod, once the gateway routes its model."""
    ladle_system.apply([service()])
    try:
        ready = ladle_system.ready_pod(NAME)
        wait_routed(gateway_url, MODEL)
        yield ready
    finally:
        ladle_system.kubectl("delete", "lisvc", NAME, "-n", ladle_system.namespace, "--wait=false")


def metrics_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:8000/metrics"


def test_the_gateway_holds_what_the_pods_slots_cannot_take(
    gateway_url: str, pod: dict[str, Any]
) -> None:
    sampler = Sampler(metrics_url(pod), gateway_url)
    load = Load(gateway_url, MODEL, concurrency=CONCURRENCY, output_len=32)
    try:
        wait_until(
            lambda: sum(1 for _, _, held in sampler.rows if held >= CONCURRENCY - SLOTS) >= 5,
            "the gateway to hold what the slots cannot take, in 5 samples",
            240,
        )
    finally:
        result = load.stop()
        rows = sampler.stop()
    assert result.clean, result
    busy = [row for row in rows if row[0] == SLOTS]
    assert busy, "the pod never ran a full batch"
    # The pod runs at most its slots and queues none of its own (a request the gateway has
    # just bound may be seen waiting for the engine's next step: at most one, rarely) ...
    waiting = [w for _, w, _ in rows]
    assert max(running for running, _, _ in rows) <= SLOTS
    assert max(waiting) <= 1
    assert sum(waiting) / len(waiting) < 0.1, waiting
    # ... while the gateway holds the rest.
    assert max(held for _, _, held in rows) == CONCURRENCY - SLOTS


def preemptions(url: str) -> float:
    page = httpx.get(url, timeout=5).text
    return sum(v for _, v in samples(page, (PREEMPTIONS,))[PREEMPTIONS])


def test_a_critical_request_displaces_a_sheddable_one_on_the_full_pod(
    gateway_url: str, pod: dict[str, Any]
) -> None:
    """Priority bands on a real pod (its InferenceService schedules by priority, the default):
    with sheddable load in every slot and in the gateway's queue, a critical request is bound
    beyond the pod's slots and the engine preempts a sheddable sequence for it, its tokens
    kept. The critical requests are answered, the pod counts the preemptions, and no
    sheddable request is lost: each displaced one resumes."""
    before = preemptions(metrics_url(pod))
    sampler = Sampler(metrics_url(pod), gateway_url)
    sheddable = {"x-ladle-priority": "sheddable"}
    # Short requests: stopping the load waits for the ones in flight.
    load = Load(gateway_url, MODEL, concurrency=CONCURRENCY, output_len=12, headers=sheddable)
    try:
        wait_until(
            lambda: any(held >= CONCURRENCY - SLOTS for _, _, held in sampler.rows),
            "the gateway to hold sheddable requests behind the full pod",
            240,
        )
        answers = [
            httpx.post(
                f"{gateway_url}/v1/completions",
                json={"model": MODEL, "prompt": f"Urgent {i}:", "max_tokens": 4},
                headers={"x-ladle-priority": "critical"},
                timeout=120,
            )
            for i in range(2)
        ]
    finally:
        result = load.stop()
        sampler.stop()
    assert [a.status_code for a in answers] == [200] * 2, [a.text for a in answers]
    # Displaced at least once (a critical request arriving as a slot frees takes it instead).
    assert preemptions(metrics_url(pod)) > before
    assert result.clean, result
