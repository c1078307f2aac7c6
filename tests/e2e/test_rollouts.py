"""Canary rollouts on the local cluster: real runtime pods, the chart's operator and gateway as
pods, load from `ladle bench serve` through the gateway.

One service is reused, in order: an int8 canary is promoted through every step, then an int4
canary that damages the output (groups of 128, round to nearest: top-1 agreement near 0.6 in
docs/quantization.md) is rolled back by the quality gate before any user traffic reaches it.
Intervals are 15 s and the quality gate scores six prompts from a ConfigMap. Then, with the
quality gate off, two steps and 10 s intervals: a canary whose engine settings make it refuse
load rolls back on the SLO gate; a rollout is paused and resumed, survives its leader hanging
and dying, and waits for a manual promotion; another is aborted. In two runs on two shared
cores (load averages about 4 and 8) the five took 126-220, 43-100, 55-67, 85-94 and 16-27 s:
the module 6 to 8.7 minutes with its cluster.
"""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import urllib3
from kube_harness import metric_total
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ladle_dev.pytest_plugin import wait_until

from .conftest import Load, System, cpu_service

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "canary"
MODEL = "canary-model"
STEPS = [25, 50, 100]
ACTION = "ladle.dev/rollout-action"
INTERVAL = 15
# Six prompts, 209 tokens (203 scored positions, the `tokens` in status): enough to score
# top-1 agreement to within a few percent.
PROMPTS = "\n".join(
    [
        "The capital of France is Paris, and the capital of Germany is Berlin. Both cities are "
        "known for their museums, their long histories and the rivers that run through them.",
        "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let "
        "it rise for an hour, shape it, let it rise again, and bake it in a hot oven.",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who went "
        "out every morning before sunrise and came back every evening with his nets full.",
        "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on "
        "high mountains, because the air pressure there is lower.",
        "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. It takes "
        "place in the chloroplasts of plant cells, which contain the green pigment chlorophyll.",
        "A good function does one thing, has a name that says what it does, and takes few "
        "arguments. Tests show that it works and keep it working when the code around it moves.",
    ]
)


INT8 = {"weights": "int8", "method": "rtn"}
ENGINE = {"kvCacheMemory": "64Mi", "maxModelLen": 512, "drainTimeoutSeconds": 5}
# The scenarios that are not about output quality: no eval, two steps, short intervals.
QUALITY_OFF = {"enabled": False}
FAST_STEPS = [50, 100]
FAST_INTERVAL = 10
FAST: dict[str, Any] = {"steps": FAST_STEPS, "intervalSeconds": FAST_INTERVAL}
# Requests a second of background load where a rollout only needs traffic to judge: a 25%
# step sees about 15 in a 15 s interval (minRequests is 3), and the load leaves the two cores
# to the pods starting and the rest of the suite.
LOAD_RATE = 4.0
# The error-rate gate alone (a ratio of 0 turns a gate off).
ERROR_RATE_ONLY = {
    "quality": QUALITY_OFF,
    "slo": {"maxErrorRateRatio": 2, "maxTTFTP95Ratio": 0, "maxTPOTP95Ratio": 0},
}


def service(
    quantization: dict[str, Any],
    quality: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    rollout: dict[str, Any] | None = None,
    routing: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return cpu_service(
        NAME,
        MODEL,
        quantization=quantization,
        engine={**ENGINE, **(engine or {})},
        **({"routing": routing} if routing is not None else {}),
        rollout={
            "steps": STEPS,
            "intervalSeconds": INTERVAL,
            "minRequests": 3,
            "progressDeadlineSeconds": 480,
            "paused": False,
            "analysis": {
                "quality": {
                    "prompts": {"configMapName": "canary-prompts", "key": "prompts.txt"},
                    **(quality or {}),
                },
                # Both variants share the same two cores with the load generator: their
                # latencies measure the machine as much as the variant. The gates run and
                # report their numbers; the bounds leave room for that noise.
                "slo": {"maxTTFTP95Ratio": 4, "maxTPOTP95Ratio": 4},
            },
            **(rollout or {}),
        },
    )


def complete(gateway_url: str, timeout: float = 60) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    return httpx.post(f"{gateway_url}/v1/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def rollouts(ladle_system: System, gateway_url: str) -> Iterator[System]:
    prompts = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "canary-prompts"},
        "data": {"prompts.txt": PROMPTS},
    }
    ladle_system.apply([prompts, service({"weights": "none"})])
    ladle_system.ready_pod(NAME)

    def routed() -> bool:
        try:
            return complete(gateway_url).is_success
        except httpx.HTTPError:
            return False

    wait_until(routed, "the gateway to route the model", 120)
    yield ladle_system
    ladle_system.kubectl("delete", "lisvc", NAME, "-n", ladle_system.namespace, "--wait=false")


class Prober:
    """One client sending requests back to back through the gateway, recording each answer's
    status and the variant that served it (``x-ladle-variant``)."""

    def __init__(self, gateway_url: str) -> None:
        self.url = gateway_url
        self.answers: list[tuple[int, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                reply = complete(self.url)
                self.answers.append((reply.status_code, reply.headers.get("x-ladle-variant", "")))
            except httpx.HTTPError as err:
                self.answers.append((0, type(err).__name__))

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        self._thread.join(timeout=90)
        return self.answers


def rollout(system: System) -> dict[str, Any]:
    """``status.rollout``, read through the API client: the tests poll it several times a
    second, and a kubectl process each time costs the two cores more than the operator does.
    A read the loaded API server did not answer in time is a poll that saw nothing."""
    try:
        obj = client.CustomObjectsApi(system.api).get_namespaced_custom_object(
            "ladle.dev", "v1alpha1", system.namespace, "inferenceservices", NAME,
            _request_timeout=10,
        )  # fmt: skip
    except (ApiException, urllib3.exceptions.HTTPError):
        return {}
    block: dict[str, Any] = (obj.get("status") or {}).get("rollout") or {}
    return block


def canary_weight(block: dict[str, Any]) -> int:
    return next(
        (int(w["weight"]) for w in block.get("weights") or () if w["variant"] == "canary"), 0
    )


def split(gateway_url: str, n: int) -> collections.Counter[str]:
    """Which variant served each of ``n`` requests, sent one after another: beside the
    background load, more clients at once push first tokens past the gateway's deadline on two
    cores, and the breaker then opens (what it is for, but not what this measures)."""
    served: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        reply = complete(gateway_url)
        assert reply.status_code == 200, reply.text
        served[reply.headers["x-ladle-variant"]] += 1
    return served


def mark() -> str:
    """An Event time from which on every Event is the caller's: Events keep whole seconds, so
    this waits for the next second to begin."""
    time.sleep(1 - time.time() % 1)
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def reasons(system: System, since: str = "") -> list[str]:
    """The service's Events in order (those last seen at or after ``since``), by reason."""
    out = system.kubectl(
        "get", "events", "-n", system.namespace,
        "--field-selector", f"involvedObject.name={NAME},involvedObject.kind=InferenceService",
        "-o", "json",
    )  # fmt: skip
    items = sorted(
        json.loads(out.stdout)["items"],
        key=lambda e: e.get("eventTime") or e.get("lastTimestamp") or "",
    )
    return [
        str(e["reason"])
        for e in items
        if (e.get("lastTimestamp") or e.get("eventTime") or "")[:19] >= since[:19]
    ]


def reasons_with(system: System, wanted: tuple[str, ...], since: str = "") -> list[str]:
    """``reasons`` once all of ``wanted`` are among them: the operator posts its Events in the
    background, after the status that the test has just read."""

    def posted() -> list[str] | None:
        events = reasons(system, since)
        return events if set(wanted) <= set(events) else None

    found: list[str] = wait_until(posted, f"the Events {', '.join(wanted)}", 30)
    return found


def show(system: System, since: str) -> None:
    """Print what a user would look at (run with -s to see it): ``kubectl get lisvc``, the
    service's Events since ``since``, and ``status.rollout`` without its templates."""
    print(system.kubectl("get", "lisvc", NAME, "-n", system.namespace).stdout)
    out = system.kubectl(
        "get", "events", "-n", system.namespace,
        "--field-selector", f"involvedObject.name={NAME},involvedObject.kind=InferenceService",
        "-o", "json",
    )  # fmt: skip
    items = sorted(
        json.loads(out.stdout)["items"],
        key=lambda e: e.get("eventTime") or e.get("lastTimestamp") or "",
    )
    for e in items:
        if (e.get("lastTimestamp") or e.get("eventTime") or "")[:19] >= since[:19]:
            print(f"{e['type']:<8} {e['reason']:<22} {e['message']}")
    block = {k: v for k, v in rollout(system).items() if not k.endswith("Template")}
    print(json.dumps(block, indent=1))


def wait_rollout(
    system: System, ok: Callable[[dict[str, Any]], bool], what: str, timeout: float
) -> dict[str, Any]:
    """``status.rollout`` once ``ok`` holds for it."""

    def check() -> dict[str, Any] | None:
        block = rollout(system)
        return block if ok(block) else None

    found: dict[str, Any] = wait_until(check, what, timeout)
    return found


def kubectl_ok(system: System, *args: str) -> None:
    result = system.kubectl(*args, "-n", system.namespace)
    assert result.returncode == 0, result.stderr


def act(system: System, action: str) -> None:
    """``kubectl annotate lisvc NAME ladle.dev/rollout-action=ACTION``."""
    kubectl_ok(system, "annotate", "--overwrite", "lisvc", NAME, f"{ACTION}={action}")


def pause(system: System, paused: bool) -> None:
    body = json.dumps({"spec": {"rollout": {"paused": paused}}})
    kubectl_ok(system, "patch", "lisvc", NAME, "--type", "merge", "-p", body)


def rolled_back(block: dict[str, Any]) -> bool:
    return block.get("phase") == "RolledBack" and "canary" not in block.get("revisions", {})


def deployments(system: System) -> dict[str, dict[str, Any]]:
    out = system.kubectl(
        "get", "deploy", "-n", system.namespace, "-l", f"ladle.dev/inferenceservice={NAME}",
        "-o", "json",
    )  # fmt: skip
    return {d["metadata"]["name"]: d for d in json.loads(out.stdout)["items"]}


def runtime_args(deployment: dict[str, Any]) -> list[str]:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return [*container.get("command", []), *container.get("args", [])]


def test_an_int8_canary_is_promoted_through_every_step(rollouts: System, gateway_url: str) -> None:
    started = time.monotonic()
    before = rollout(rollouts)
    assert before["phase"] == "Idle"
    stable_revision = before["revisions"]["stable"]
    # The default model ships 4-bit (Q4_1): int8 on top of it keeps top-1 near 0.95, below
    # the int8 default of 0.97 (docs/quantization.md), so this service states its own gate.
    rollouts.apply([service(INT8, {"minTop1Agreement": 0.85, "maxKLD": 0.02})])
    # No user traffic reaches the canary before the quality gate has passed (the rollback test
    # below shows it with traffic); the load the SLO gates need starts with step 1, so that
    # the check before traffic does not share the two cores with it.
    first = wait_until(
        lambda: (b := rollout(rollouts)).get("step") == 1 and b,
        "the quality gate to pass and step 1 to start",
        240,
    )
    assert first["quality"]["result"] == "Pass"
    assert first["quality"]["top1Agreement"] >= 0.85
    load = Load(gateway_url, MODEL, concurrency=4, output_len=4, rate=LOAD_RATE)
    try:
        for step, weight in enumerate(STEPS, 1):
            block = wait_until(
                lambda s=step: (
                    (b := rollout(rollouts)).get("step") == s
                    and b.get("stage") == "Analysing"
                    and b
                ),
                f"step {step} analysing",
                240,
            )
            assert canary_weight(block) == weight
            assert block["phase"] == "Progressing"
            # `kubectl get lisvc` shows the phase and the canary's weight. Read at once: the
            # step cannot move on before its first interval (15 s) has ended.
            lisvc = rollouts.kubectl("get", "lisvc", NAME, "-n", rollouts.namespace)
            # Then hold the step with the documented pause while it is sampled, however long
            # sampling takes under load; the resume starts the step's interval again.
            pause(rollouts, True)
            held = wait_rollout(
                rollouts, lambda b: b.get("phase") == "Paused", f"step {step} paused", 30
            )
            # Still this step: so the columns above were read at it, too.
            assert (held["step"], canary_weight(held), held["stage"]) == (
                step,
                weight,
                "Analysing",
            ), held
            columns = lisvc.stdout.splitlines()[1].split()
            assert columns[-3:-1] == ["Progressing", str(weight)], lisvc.stdout
            # 24 draws: a 25% canary goes unseen with probability 0.75^24, about 0.1%.
            sample = split(gateway_url, 24)
            if weight == 100:
                assert sample == {"canary": 24}, sample
            else:
                assert sample["canary"] >= 1, (weight, sample)
                assert sample["stable"] >= 1, (weight, sample)
            # Events: this step started once, as every one before it (and is paused now).
            events = wait_until(
                lambda s=step: (e := reasons(rollouts)).count("RolloutPaused") == s and e,
                f"the RolloutPaused Event of step {step}",
                30,
            )
            assert events.count("StepStarted") == step, events
            pause(rollouts, False)
            wait_rollout(
                rollouts, lambda b: b.get("phase") == "Progressing", f"step {step} resumed", 30
            )
        done = wait_until(
            lambda: (b := rollout(rollouts)).get("phase") == "Promoted" and b,
            "the promotion",
            240,
        )
        # The load runs on until the old canary's pods are gone: the whole swap.
        wait_until(
            lambda: list(deployments(rollouts)) == [f"{NAME}-stable"], "the canary removed", 60
        )
    finally:
        served = load.stop()
    print(f"\nint8 canary promoted in {time.monotonic() - started:.0f}s; load: {served}")
    # No request was dropped at any step, in the promotion or in the swap of revisions.
    assert served.clean, served
    assert done["revisions"]["stable"] != stable_revision
    assert "canary" not in done["revisions"]
    assert done.get("weights") is None  # all traffic on stable again
    analysis = done["lastAnalysis"]
    assert analysis["result"] == "Pass"
    assert {g["gate"] for g in analysis["gates"]} >= {"errorRate", "ttftP95", "tpotP95"}
    events = reasons_with(
        rollouts, ("RolloutStarted", "QualityGatePassed", "AnalysisPassed", "Promoting", "Promoted")
    )
    assert events.count("StepStarted") == len(STEPS), events
    assert events.count("RolloutResumed") == len(STEPS), events
    # The stable Deployment now runs int8, and the canary's is gone.
    args = runtime_args(deployments(rollouts)[f"{NAME}-stable"])
    assert "int8" in args, args
    assert split(gateway_url, 4) == {"stable": 4}


def test_a_canary_that_damages_the_output_rolls_back_on_the_quality_gate(
    rollouts: System, gateway_url: str
) -> None:
    started = time.monotonic()
    since = mark()
    stable_revision = rollout(rollouts)["revisions"]["stable"]
    prober = Prober(gateway_url)
    try:
        rollouts.apply([service({"weights": "int4", "groupSize": 128, "method": "rtn"})])
        done = wait_until(
            lambda: (
                (b := rollout(rollouts)).get("phase") == "RolledBack"
                and "canary" not in b.get("revisions", {})
                and b
            ),
            "the rollback",
            300,
        )
    finally:
        answers = prober.stop()
    print(f"\nint4 g128 canary rolled back in {time.monotonic() - started:.0f}s")
    show(rollouts, since)
    assert done["reason"] == "QualityGateFailed"
    # The measured numbers, e.g. "top-1 agreement 0.62 < 0.9; perplexity +85.1% > +5% (...)".
    assert "top-1 agreement" in done["message"], done["message"]
    assert " < 0.9" in done["message"], done["message"]
    assert done["quality"]["result"] == "Fail"
    assert done["quality"]["top1Agreement"] < 0.9
    assert done["revisions"]["stable"] == stable_revision
    assert done["revisions"]["failed"] != stable_revision
    isvc = rollouts.isvc(NAME)
    assert rollouts.condition(isvc, "Ready") == "True"  # stable serves throughout
    assert rollouts.condition(isvc, "Degraded") == "True"
    degraded = next(c for c in isvc["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "QualityGateFailed"
    reasons_with(rollouts, ("RolledBack",))
    # Every request was served, and by stable: no user traffic ever reached the canary.
    assert answers, "the prober sent nothing"
    assert {code for code, _ in answers} == {200}, collections.Counter(answers)
    assert {variant for _, variant in answers} == {"stable"}
    wait_until(lambda: list(deployments(rollouts)) == [f"{NAME}-stable"], "the canary removed", 60)
    # The failed revision is held: nothing starts again until the spec changes or a retry.
    reconcile_after(rollouts)
    assert rollout(rollouts)["phase"] == "RolledBack"
    assert list(deployments(rollouts)) == [f"{NAME}-stable"]


def test_a_canary_that_refuses_requests_rolls_back_on_the_slo_gate(
    rollouts: System, gateway_url: str
) -> None:
    """The canary's engine runs one sequence at a time and lets one more wait: real settings
    (``--max-num-seqs``, ``--max-waiting-requests``), too tight for the load, so it answers 429
    to what it cannot queue, and its pods count those refusals. Stable refuses nothing. Step 1
    sends half of eight requests a second to a canary that holds two, so it fails there. The
    load is open (a rate, not clients back to back): with eight clients in a closed loop, a
    slow stable held most of them, the quick canary never saw three at once, and step 1
    passed. Each request asks for 64 tokens, so that the canary is busy a second or more with
    each: at 4 tokens, and again at 16 once pods ran one compute thread each, a quick canary
    finished each before the next two came, and step 1 passed. The gateway binds early
    (``routing.maxConcurrency: 0``): binding late, it would hold what the canary cannot take,
    and the canary would refuse nothing. The latency gates are off: a canary that queues is
    slow as well, and early in an interval, before three of stable's 64-token requests have
    finished, the TTFT gate (counted at the first token) can judge before the error rate."""
    started = time.monotonic()
    since = mark()
    stable_revision = rollout(rollouts)["revisions"]["stable"]
    rollouts.apply(
        [
            service(
                INT8,
                QUALITY_OFF,
                engine={"maxNumSeqs": 1, "maxWaitingRequests": 1},
                rollout={**FAST, "failureLimit": 1, "analysis": ERROR_RATE_ONLY},
                routing={"maxConcurrency": 0},
            )
        ]
    )
    # The load starts with step 1: the canary's pod starts faster without it.
    wait_rollout(rollouts, lambda b: b.get("step") == 1, "step 1", 240)
    load = Load(gateway_url, MODEL, concurrency=32, output_len=64, rate=2 * LOAD_RATE)
    try:
        done = wait_rollout(rollouts, rolled_back, "the rollback on the SLO gate", 180)
    finally:
        load.stop()
    print(f"\nrefusing canary rolled back in {time.monotonic() - started:.0f}s")
    assert done["reason"] == "SLOGateFailed", done
    # The numbers, e.g. "error rate 31.0% vs stable 0.0%: 31.00x > 2x (58 and 12 requests)".
    assert done["message"].startswith("SLOGateFailed: error rate "), done["message"]
    analysis = done["lastAnalysis"]
    assert (analysis["step"], analysis["result"]) == (1, "Fail")
    gates = {g["gate"]: g for g in analysis["gates"]}
    assert set(gates) == {"errorRate"}  # the others turned off: this rollout is about refusals
    assert gates["errorRate"]["result"] == "Fail"
    numbers = re.fullmatch(
        r"error rate ([\d.]+)% vs stable ([\d.]+)%: ([\d.]+)x > 2x \((\d+) and (\d+) requests\)",
        gates["errorRate"]["message"],
    )
    assert numbers, gates["errorRate"]["message"]
    canary_rate, stable_rate, ratio = (float(numbers[i]) for i in (1, 2, 3))
    assert canary_rate > 2
    assert stable_rate == 0
    assert ratio > 2
    assert min(int(numbers[4]), int(numbers[5])) >= 3  # minRequests on both sides
    assert done["revisions"]["stable"] == stable_revision
    assert done["revisions"]["failed"] not in (stable_revision, None)
    isvc = rollouts.isvc(NAME)
    assert rollouts.condition(isvc, "Ready") == "True"
    degraded = next(c for c in isvc["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "SLOGateFailed")
    assert "error rate" in degraded["message"]
    reasons_with(rollouts, ("RolloutStarted", "StepStarted", "AnalysisFailed", "RolledBack"), since)
    # Traffic is back on stable, and the canary is gone.
    assert split(gateway_url, 8) == {"stable": 8}
    wait_until(lambda: list(deployments(rollouts)) == [f"{NAME}-stable"], "the canary removed", 60)


def leader_pod(system: System) -> dict[str, Any]:
    """The operator pod that holds the leader Lease (its identity is its pod name)."""
    holder = system.kubectl(
        "get", "lease", "ladle-operator", "-n", system.system_namespace,
        "-o", "jsonpath={.spec.holderIdentity}",
    ).stdout.strip()  # fmt: skip
    pods = system.kubectl(
        "get", "pods", "-n", system.system_namespace,
        "-l", "app.kubernetes.io/component!=gateway", "-o", "json",
    )  # fmt: skip
    found = [p for p in json.loads(pods.stdout)["items"] if p["metadata"]["name"] == holder]
    assert found, f"no operator pod named {holder!r} holds the Lease"
    return found[0]


def reconcile_after(system: System) -> None:
    """Annotate the service and return once the leading operator has reconciled a service
    after that: "nothing changed" is then checked against a look it took, not a sleep."""

    def reconciles() -> float:
        pod = leader_pod(system)
        port = next(
            p["containerPort"]
            for c in pod["spec"]["containers"]
            for p in c.get("ports", ())
            if p.get("name") == "metrics"
        )
        text = httpx.get(f"http://{pod['status']['podIP']}:{port}/metrics", timeout=5).text
        return metric_total(text, "ladle_operator_reconcile_total", kind="isvc") or 0.0

    before = reconciles()
    kubectl_ok(system, "annotate", "--overwrite", "lisvc", NAME, f"test.ladle.dev/poke={before}")
    wait_until(lambda: reconciles() > before, "a reconcile of the service", 60)


def test_pause_resume_a_leader_failover_and_manual_promotion(
    rollouts: System, gateway_url: str
) -> None:
    started = time.monotonic()
    since = mark()
    rollouts.apply(
        [service(INT8, QUALITY_OFF, engine={"seed": 7}, rollout={**FAST, "manualPromotion": True})]
    )
    first = wait_rollout(
        rollouts,
        lambda b: b.get("step") == 1 and b.get("stage") == "Analysing",
        "step 1 analysing",
        240,
    )
    canary_revision = first["revisions"]["canary"]

    # Paused: the weights and the split hold, and no interval concludes. (The load the steps
    # need starts on resume: without it the split is sampled quickly.)
    pause(rollouts, True)
    paused = wait_rollout(rollouts, lambda b: b.get("phase") == "Paused", "the pause", 30)
    interval_over = time.monotonic() + FAST_INTERVAL
    assert (paused["step"], canary_weight(paused), paused["stage"]) == (1, 50, "Analysing")
    verdicts = [r for r in reasons(rollouts, since) if r.startswith("Analysis")]
    sample = split(gateway_url, 12)  # a 50% canary unseen in 12 draws: 0.05%
    assert sample["canary"] >= 1, sample
    assert sample["stable"] >= 1, sample
    # An interval would have ended by now; the operator looks once more after that.
    time.sleep(max(0.0, interval_over - time.monotonic()))
    reconcile_after(rollouts)
    held = rollout(rollouts)
    assert (held["phase"], held["step"], canary_weight(held)) == ("Paused", 1, 50), held
    assert [r for r in reasons(rollouts, since) if r.startswith("Analysis")] == verdicts
    load = Load(gateway_url, MODEL, concurrency=4, output_len=4, rate=LOAD_RATE)
    try:
        pause(rollouts, False)
        wait_rollout(rollouts, lambda b: b.get("phase") == "Progressing", "the resume", 30)

        # The leader hangs (it can neither renew its Lease nor write), then dies: the standby
        # takes the Lease once it expires and carries on from status.rollout.
        victim = leader_pod(rollouts)
        pid = rollouts.container_pid(victim, "operator")
        os.kill(pid, signal.SIGSTOP)
        try:
            at_stop = rollout(rollouts)
            wait_until(
                lambda: leader_pod(rollouts)["metadata"]["name"] != victim["metadata"]["name"],
                "the standby to take the Lease",
                60,
            )
            taken = rollout(rollouts)
        finally:
            os.kill(pid, signal.SIGKILL)
        assert taken["revisions"]["canary"] == canary_revision
        assert (taken["step"], canary_weight(taken)) == (at_stop["step"], canary_weight(at_stop))
        steps_seen = [taken["step"]]

        def awaiting() -> dict[str, Any] | None:
            block = rollout(rollouts)
            steps_seen.append(int(block.get("step") or 0))
            return block if block.get("stage") == "AwaitingPromotion" else None

        waiting: dict[str, Any] = wait_until(awaiting, "every step to pass", 180)
    finally:
        load.stop()
    # It went on from where it was, never back to an earlier step.
    assert steps_seen == sorted(steps_seen), steps_seen
    assert waiting["revisions"]["canary"] == canary_revision
    assert (waiting["phase"], waiting["step"], canary_weight(waiting)) == ("Paused", 2, 100)
    events = reasons_with(rollouts, ("RolloutPaused", "RolloutResumed", "AwaitingPromotion"), since)
    assert events.count("RolloutStarted") == 1, events
    assert "RolloutRestarted" not in events, events
    assert events.count("StepStarted") == len(FAST_STEPS), events

    # The manual gate: nothing happens until the annotation, which the operator then removes.
    act(rollouts, "promote")
    done = wait_rollout(rollouts, lambda b: b.get("phase") == "Promoted", "the promotion", 240)
    print(f"\npaused, failed over and promoted by hand in {time.monotonic() - started:.0f}s")
    assert done["revisions"]["stable"] == canary_revision
    assert ACTION not in rollouts.isvc(NAME)["metadata"].get("annotations", {})
    events = reasons_with(rollouts, ("PromotionApproved", "Promoting", "Promoted"), since)
    # Removed once, right after it was acted on: never read again and refused.
    assert "RolloutActionIgnored" not in events, events
    wait_until(lambda: list(deployments(rollouts)) == [f"{NAME}-stable"], "the canary removed", 60)
    args = runtime_args(deployments(rollouts)[f"{NAME}-stable"])
    assert args[args.index("--seed") + 1] == "7", args
    assert split(gateway_url, 4) == {"stable": 4}


def test_abort_sends_traffic_back_to_stable_and_removes_the_canary(
    rollouts: System, gateway_url: str
) -> None:
    started = time.monotonic()
    since = mark()
    stable_revision = rollout(rollouts)["revisions"]["stable"]
    # No load: step 1's analysis stays inconclusive, so the canary holds 50% until the abort.
    rollouts.apply([service(INT8, QUALITY_OFF, engine={"seed": 8}, rollout=FAST)])
    step = wait_rollout(
        rollouts,
        lambda b: b.get("step") == 1 and b.get("stage") == "Analysing",
        "step 1 analysing",
        240,
    )
    sample = split(gateway_url, 12)
    assert sample["canary"] >= 1, sample
    assert sample["stable"] >= 1, sample
    act(rollouts, "abort")
    done = wait_rollout(rollouts, rolled_back, "the abort", 60)
    print(f"\ncanary aborted in {time.monotonic() - started:.0f}s")
    assert done["reason"] == "Aborted"
    assert done["revisions"] == {"stable": stable_revision, "failed": step["revisions"]["canary"]}
    assert ACTION not in rollouts.isvc(NAME)["metadata"].get("annotations", {})
    isvc = rollouts.isvc(NAME)
    assert rollouts.condition(isvc, "Ready") == "True"
    degraded = next(c for c in isvc["status"]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "Aborted")
    events = reasons_with(rollouts, ("RolledBack",), since)
    assert "RolloutActionIgnored" not in events, events
    assert split(gateway_url, 8) == {"stable": 8}
    wait_until(lambda: list(deployments(rollouts)) == [f"{NAME}-stable"], "the canary removed", 60)
