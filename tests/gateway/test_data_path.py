"""The gateway's data path over real sockets, against scriptable fake pods."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from ladle.gateway.breaker import State
from ladle.gateway.routes import Pod, build_table

pytestmark = pytest.mark.timeout(60)


def sample(gateway: Any, name: str, **labels: str) -> float:
    value = gateway.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


async def post(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], **kw: Any
) -> httpx.Response:
    return await client.post(url + "/v1/completions", json=body, **kw)


async def test_routes_by_model_lists_models_and_passes_the_request_id(
    fake_pods: Any, run_gateway: Any
) -> None:
    a, b = await fake_pods(), await fake_pods()
    gw = await run_gateway(
        [
            {"name": "chat", "model": "m-a", "endpoints": [a.url]},
            {"name": "code", "model": "m-b", "endpoints": [b.url]},
        ]
    )
    async with httpx.AsyncClient() as client:
        models = (await client.get(gw.url + "/v1/models")).json()
        assert sorted(m["id"] for m in models["data"]) == ["m-a", "m-b"]
        r = await post(
            client, gw.url, {"model": "m-b", "prompt": "x"}, headers={"x-request-id": "req-42"}
        )
        assert r.status_code == 200
        assert r.headers["x-request-id"] == "req-42"
        assert r.headers["x-ladle-variant"] == "stable"
        assert [s.body["model"] for s in b.seen] == ["m-b"]
        assert not a.seen
        assert b.seen[0].headers["x-request-id"] == "req-42"
        missing = await post(client, gw.url, {"model": "nope", "prompt": "x"})
        assert missing.status_code == 404
        err = missing.json()["error"]
        assert err["code"] == "model_not_found"
        assert err["type"] == "not_found_error"
        assert err["param"] == "model"
        bad = await client.post(gw.url + "/v1/completions", content=b"{not json")
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_json"


async def test_retries_another_pod_before_the_first_byte(fake_pods: Any, run_gateway: Any) -> None:
    sick, healthy = await fake_pods(mode="status:503"), await fake_pods()
    dead = await fake_pods()
    await dead.stop()  # connection refused
    routes = {"prefixAffinity": False}  # least outstanding, random ties: every pod gets tried
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": "m",
                "endpoints": [sick.url, dead.url, healthy.url],
                "routing": routes,
            }
        ]
    )
    async with httpx.AsyncClient() as client:
        for _ in range(6):
            r = await post(client, gw.url, {"model": "m", "prompt": "x"})
            assert r.status_code == 200
    assert len(healthy.seen) == 6
    assert (
        sample(gw.gateway, "ladle_gateway_retries_total", namespace="default", service="chat") > 0
    )


async def test_the_last_attempt_answers_with_the_pods_own_error(
    fake_pods: Any, run_gateway: Any
) -> None:
    pods = [await fake_pods(mode="status:503") for _ in range(3)]
    gw = await run_gateway([{"name": "chat", "model": "m", "endpoints": [p.url for p in pods]}])
    async with httpx.AsyncClient() as client:
        r = await post(client, gw.url, {"model": "m", "prompt": "x"})
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "pod says 503"
    assert sum(len(p.seen) for p in pods) == 3  # one try and at most two retries


async def test_a_stream_cut_mid_way_ends_with_an_error_event_not_a_hang(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(mode="die_mid_stream", chunks=3)
    gw = await run_gateway([{"name": "chat", "model": "m", "endpoints": [pod.url]}])
    async with (
        httpx.AsyncClient() as client,
        client.stream(
            "POST", gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        ) as r,
    ):
        text = (await asyncio.wait_for(r.aread(), 10)).decode()
    events = [e for e in text.split("\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
    error = json.loads(events[-1][6:])["error"]
    assert error["code"] == "upstream_disconnected"
    assert len(events) == 3  # the half-sent third event was dropped, not passed on broken


async def test_first_token_timeout_is_a_504_and_a_breaker_failure(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(mode="hang")
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": "m",
                "endpoints": [pod.url],
                "timeouts": {"firstTokenSeconds": 1},
                "circuitBreaker": {"minimumCalls": 1, "openSeconds": 30},
            }
        ]
    )
    async with httpx.AsyncClient(timeout=10) as client:
        started = time.monotonic()
        r = await post(client, gw.url, {"model": "m", "prompt": "x"})
        answered = time.monotonic()
        assert r.status_code == 504
        assert r.json()["error"]["code"] == "first_token_timeout"
        # Not before the deadline; that it fired at all is the 504 (the pod never answers, and
        # the client would have timed out after 10 s).
        assert answered - started >= 0.9
        await asyncio.sleep(2)  # so that the time left differs from the whole open period
        asked = time.monotonic()
        again = await post(client, gw.url, {"model": "m", "prompt": "x"})
        replied = time.monotonic()
    assert again.status_code == 503
    # The same type as the runtime's own 503s (one error table for both servers).
    assert again.json()["error"]["type"] == "service_unavailable_error"
    assert again.json()["error"]["code"] == "circuit_open"
    # The breaker opened between the request and its 504, and the refusal was decided between
    # asking and the reply: Retry-After is what is left of the 30 s, rounded up.
    left = (30 - (replied - started), 30 - (asked - answered))
    assert math.ceil(left[0]) <= int(again.headers["retry-after"]) <= math.ceil(left[1])
    # Both count against the service in requests_total, which the availability SLO reads; the
    # refusal before any variant was picked has none.
    for variant, code in (("stable", "504"), ("", "503")):
        labels = {"namespace": "default", "service": "chat", "variant": variant, "code": code}
        assert sample(gw.gateway, "ladle_gateway_requests_total", **labels) == 1, code


async def test_a_clients_own_deadline_is_a_504_that_does_not_count_against_the_service(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(delay=5)
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": "m",
                "endpoints": [pod.url],
                "circuitBreaker": {"minimumCalls": 1},
            }
        ]
    )
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(2):
            r = await post(
                client, gw.url, {"model": "m", "prompt": "x"}, headers={"x-ladle-timeout": "0.3"}
            )
            assert r.status_code == 504
            assert r.json()["error"]["code"] == "deadline_exceeded"  # never circuit_open
        bad = await post(
            client, gw.url, {"model": "m", "prompt": "x"}, headers={"x-ladle-timeout": "soon"}
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["code"] == "invalid_timeout"


async def test_breaker_trips_to_the_fallback_half_opens_and_closes(
    fake_pods: Any, run_gateway: Any
) -> None:
    main, backup = await fake_pods(mode="status:500"), await fake_pods()
    breaker = {"minimumCalls": 4, "windowSeconds": 30, "openSeconds": 1, "halfOpenProbes": 2}
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": "big",
                "endpoints": [main.url],
                "fallback": "backup",
                "circuitBreaker": breaker,
            },
            {"name": "backup", "model": "small", "endpoints": [backup.url]},
        ]
    )
    labels = {"namespace": "default", "service": "chat"}
    async with httpx.AsyncClient() as client:
        for _ in range(4):
            assert (await post(client, gw.url, {"model": "big", "prompt": "x"})).status_code == 500
        assert sample(gw.gateway, "ladle_gateway_breaker_state", state="Open", **labels) == 1
        r = await post(client, gw.url, {"model": "big", "prompt": "x"})
        assert r.status_code == 200
        assert r.headers["x-ladle-fallback"] == "backup"
        assert backup.seen[-1].body["model"] == "small"  # the model was rewritten
        assert len(main.seen) == 4
        main.mode = "ok"
        await asyncio.sleep(1.1)
        for _ in range(2):  # the probes
            r = await post(client, gw.url, {"model": "big", "prompt": "x"})
            assert r.status_code == 200
            assert "x-ladle-fallback" not in r.headers
        assert sample(gw.gateway, "ladle_gateway_breaker_state", state="Closed", **labels) == 1
    for state in State:
        assert (
            sample(
                gw.gateway, "ladle_gateway_breaker_transitions_total", state=state.value, **labels
            )
            >= 1
        )
    assert sample(gw.gateway, "ladle_gateway_fallbacks_total", fallback="backup", **labels) == 1


async def test_an_outlier_pod_is_ejected(fake_pods: Any, run_gateway: Any) -> None:
    sick, a, b = await fake_pods(mode="status:502"), await fake_pods(), await fake_pods()
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": "m",
                "endpoints": [sick.url, a.url, b.url],
                "circuitBreaker": {"enabled": False},
                "routing": {"prefixAffinity": False, "retries": 0},
            }
        ]
    )
    async with httpx.AsyncClient() as client:
        for _ in range(60):
            await post(client, gw.url, {"model": "m", "prompt": "x"})
        hits = len(sick.seen)
        for _ in range(20):
            await post(client, gw.url, {"model": "m", "prompt": "x"})
    assert hits == 5
    assert len(sick.seen) == 5
    assert (
        sample(gw.gateway, "ladle_gateway_ejected_pods", namespace="default", service="chat") == 1
    )


async def test_canary_split_header_and_sticky_sessions(fake_pods: Any, run_gateway: Any) -> None:
    stable, canary = await fake_pods(), await fake_pods()
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": "m",
                "variants": {
                    "stable": {"weight": 70, "endpoints": [stable.url]},
                    "canary": {"weight": 30, "endpoints": [canary.url]},
                },
            }
        ]
    )
    async with httpx.AsyncClient() as client:
        seen = [
            (await post(client, gw.url, {"model": "m", "prompt": "x"})).headers["x-ladle-variant"]
            for _ in range(200)
        ]
        assert 0.15 < seen.count("canary") / 200 < 0.45
        for session in ("alice", "bob", "carol"):
            variants = {
                (
                    await post(client, gw.url, {"model": "m", "prompt": "x", "user": session})
                ).headers["x-ladle-variant"]
                for _ in range(10)
            }
            assert len(variants) == 1
            header = {
                (
                    await post(
                        client,
                        gw.url,
                        {"model": "m", "prompt": "x"},
                        headers={"x-session-id": session},
                    )
                ).headers["x-ladle-variant"]
                for _ in range(10)
            }
            assert len(header) == 1


async def test_shared_prefixes_stay_on_one_pod(fake_pods: Any, run_gateway: Any) -> None:
    pods = [await fake_pods() for _ in range(3)]
    gw = await run_gateway([{"name": "chat", "model": "m", "endpoints": [p.url for p in pods]}])
    system = "You are a terse assistant for the Ladle project. " * 4
    async with httpx.AsyncClient() as client:
        for i in range(30):
            body = {
                "model": "m",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"q{i}"},
                ],
            }
            assert (
                await client.post(gw.url + "/v1/chat/completions", json=body)
            ).status_code == 200
    counts = sorted(len(p.seen) for p in pods)
    assert counts == [0, 0, 30]  # sequential requests never exceed the bound


async def test_an_adapters_requests_stay_on_its_pods_and_a_popular_one_spills_over(
    fake_pods: Any, run_gateway: Any
) -> None:
    """Whatever the prompt, one adapter's requests land on one pod while its load allows (so
    the adapter stays resident there), different adapters spread, and a burst of one adapter
    spills to more pods instead of queueing on one."""
    pods = [await fake_pods() for _ in range(4)]
    adapters = [f"lora-{i}" for i in range(8)]
    gw = await run_gateway(
        [
            {
                "name": "chat",
                "model": "m",
                "endpoints": [p.url for p in pods],
                "adapters": adapters,
                "routing": {"prefixAffinity": False},
            }
        ]
    )

    def homes() -> dict[str, set[int]]:
        seen: dict[str, set[int]] = {}
        for i, pod in enumerate(pods):
            for request in pod.seen:
                seen.setdefault(request.body["model"], set()).add(i)
        return seen

    async with httpx.AsyncClient(timeout=10) as client:
        for i in range(40):
            body = {"model": adapters[i % 8], "prompt": f"a different prompt each time {i}"}
            assert (await post(client, gw.url, body)).status_code == 200
        sequential = homes()
        assert all(len(sequential[a]) == 1 for a in adapters), sequential
        assert len(set().union(*sequential.values())) >= 3, "eight adapters on too few pods"
        for pod in pods:
            pod.seen.clear()
            pod.delay = 0.3  # so that the burst's requests overlap
        burst = [post(client, gw.url, {"model": "lora-0", "prompt": "x"}) for _ in range(12)]
        assert all(r.status_code == 200 for r in await asyncio.gather(*burst))
    assert len(homes()["lora-0"]) > 1, "a burst of one adapter stayed on one pod"


async def test_scale_from_zero_holds_until_a_pod_is_ready(fake_pods: Any, run_gateway: Any) -> None:
    pod = await fake_pods()
    gw = await run_gateway(
        [{"name": "chat", "model": "m", "endpoints": [], "timeouts": {"scaleFromZeroSeconds": 5}}]
    )
    cluster = gw.gateway.cluster
    async with httpx.AsyncClient(timeout=10) as client:
        request = asyncio.ensure_future(post(client, gw.url, {"model": "m", "prompt": "x"}))
        await asyncio.sleep(0.3)
        assert not request.done()
        held_now = sample(
            gw.gateway,
            "ladle_gateway_held_requests",
            namespace="default",
            service="chat",
            band="standard",
        )
        assert held_now == 1
        service = cluster.table.services[("default", "chat")]
        ready = Pod("default", "chat-0", "chat", "stable", "127.0.0.1", pod.port, True)
        cluster.update(build_table([service], [ready]), asyncio.get_running_loop().time())
        r = await request
        assert r.status_code == 200
        assert len(pod.seen) == 1
        cluster.update(build_table([service], []), asyncio.get_running_loop().time())
        held = await post(
            client, gw.url, {"model": "m", "prompt": "x"}, headers={"x-ladle-timeout": "0.5"}
        )
    assert held.status_code == 503
    assert held.json()["error"]["code"] == "no_ready_pods"


async def test_a_client_that_leaves_mid_stream_closes_the_pod_connection(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(mode="stream", chunks=50, chunk_gap=0.05)
    gw = await run_gateway([{"name": "chat", "model": "m", "endpoints": [pod.url]}])
    async with (
        httpx.AsyncClient() as client,
        client.stream(
            "POST", gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        ) as r,
    ):
        async for _ in r.aiter_bytes():
            break
    for _ in range(50):
        if pod.disconnects:
            break
        await asyncio.sleep(0.05)
    assert pod.disconnects == 1
    await asyncio.sleep(0.1)
    assert (
        sample(
            gw.gateway,
            "ladle_gateway_requests_total",
            namespace="default",
            service="chat",
            variant="stable",
            code="499",
        )
        == 1
    )


async def test_a_client_that_hangs_up_after_done_was_served_in_full(
    fake_pods: Any, run_gateway: Any
) -> None:
    # The openai package closes the connection as soon as it reads [DONE]; the pod's body ends
    # later. That is a complete answer, not a 499.
    pod = await fake_pods(mode="stream", hold_body=asyncio.Event())
    gw = await run_gateway([{"name": "chat", "model": "m", "endpoints": [pod.url]}])
    body = {"model": "m", "prompt": "x", "stream": True}
    async with httpx.AsyncClient() as client:
        for hang_up in (True, False):
            # Read to the end when not hanging up: the reply ends at [DONE] while the pod still
            # holds its body open (were the gateway to wait for the pod, this read would time out).
            async with client.stream("POST", gw.url + "/v1/completions", json=body) as r:
                lines = []
                async for line in r.aiter_lines():
                    lines.append(line)
                    if hang_up and line == "data: [DONE]":
                        break
            assert [line for line in lines if line][-1] == "data: [DONE]"
    assert pod.hold_body is not None
    pod.hold_body.set()
    ok = {"namespace": "default", "service": "chat", "variant": "stable", "code": "200"}
    for _ in range(200):
        if sample(gw.gateway, "ladle_gateway_requests_total", **ok) == 2:
            break
        await asyncio.sleep(0.05)
    codes = {
        code: sample(
            gw.gateway,
            "ladle_gateway_requests_total",
            namespace="default",
            service="chat",
            variant="stable",
            code=code,
        )
        for code in ("200", "499")
    }
    assert codes == {"200": 2, "499": 0}
    # The gateway read the pod's body to its end and kept the connection.
    assert pod.disconnects == 0


async def test_a_pod_that_holds_its_body_open_after_done_is_let_go(
    fake_pods: Any, run_gateway: Any
) -> None:
    pod = await fake_pods(mode="stream", hold_body=asyncio.Event())  # never set
    gw = await run_gateway([{"name": "chat", "model": "m", "endpoints": [pod.url]}])
    async with httpx.AsyncClient() as client:
        reply = await client.post(
            gw.url + "/v1/completions", json={"model": "m", "prompt": "x", "stream": True}
        )
    assert reply.text.endswith("data: [DONE]\n\n")
    # Still in flight (the autoscaler's demand) until the gateway gives up on the pod's end.
    in_flight = {"namespace": "default", "service": "chat", "variant": "stable"}
    assert sample(gw.gateway, "ladle_gateway_in_flight_requests", **in_flight) == 1
    ok = {**in_flight, "code": "200"}
    for _ in range(40):
        if sample(gw.gateway, "ladle_gateway_requests_total", **ok):
            break
        await asyncio.sleep(0.05)
    assert sample(gw.gateway, "ladle_gateway_requests_total", **ok) == 1
    assert sample(gw.gateway, "ladle_gateway_in_flight_requests", **in_flight) == 0
    # The pod's server sees the gateway hang up a moment after the gateway counted the request.
    for _ in range(50):
        if pod.disconnects:
            break
        await asyncio.sleep(0.05)
    assert pod.disconnects == 1


KEYS = """
keys:
  - name: team-a
    key: sk-team-a-secret-1
    requestsPerMinute: 3
  - name: batch
    key: sk-batch-secret-22
    tokensPerMinute: 20
"""


async def test_api_keys_limits_and_logs_name_the_key_never_the_key(
    fake_pods: Any, run_gateway: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(KEYS)
    pod = await fake_pods()
    gw = await run_gateway(
        [{"name": "chat", "model": "m", "endpoints": [pod.url]}], api_keys_file=keys
    )
    caplog.set_level(logging.INFO, logger="ladle.gateway.access")
    body = {"model": "m", "prompt": "x"}
    async with httpx.AsyncClient() as client:
        assert (await post(client, gw.url, body)).status_code == 401
        assert (await client.get(gw.url + "/v1/models")).status_code == 401
        listed = await client.get(
            gw.url + "/v1/models", headers={"authorization": "Bearer sk-batch-secret-22"}
        )
        assert [m["id"] for m in listed.json()["data"]] == ["m"]
        wrong = await post(client, gw.url, body, headers={"authorization": "Bearer sk-nope-000000"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["type"] == "authentication_error"
        team = {"authorization": "Bearer sk-team-a-secret-1"}
        first = time.monotonic()
        codes = [(await post(client, gw.url, body, headers=team)).status_code for _ in range(4)]
        assert codes == [200, 200, 200, 429]
        limited = await post(client, gw.url, body, headers=team)
        assert limited.json()["error"]["type"] == "rate_limit_error"
        # 3 a minute: the first request's share comes back 20 s after it, whole seconds up.
        wait = 20 - (time.monotonic() - first)
        assert wait - 1 <= int(limited.headers["retry-after"]) <= math.ceil(wait) + 1
        batch = {"authorization": "Bearer sk-batch-secret-22"}
        # 15 tokens per answer against 20 per minute: the second answer puts the key in debt.
        assert (await post(client, gw.url, body, headers=batch)).status_code == 200
        assert (await post(client, gw.url, body, headers=batch)).status_code == 200
        over = await post(client, gw.url, body, headers=batch)
        assert over.status_code == 429
        assert "tokens per minute" in over.json()["error"]["message"]
    logged = "\n".join(json.dumps(r.__dict__, default=str) for r in caplog.records)
    assert '"key": "team-a"' in logged
    assert '"key": "batch"' in logged
    assert "sk-team-a-secret-1" not in logged
    assert "sk-batch-secret-22" not in logged
    assert (
        sample(gw.gateway, "ladle_gateway_rate_limited_total", key="team-a", limit="requests") == 2
    )


async def test_a_token_limited_stream_is_counted_without_the_client_seeing_usage(
    fake_pods: Any, run_gateway: Any, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys: [{name: batch, key: sk-batch-secret-22, tokensPerMinute: 600}]")
    pod = await fake_pods()
    gw = await run_gateway(
        [{"name": "chat", "model": "m", "endpoints": [pod.url]}], api_keys_file=keys
    )
    auth = {"authorization": "Bearer sk-batch-secret-22"}
    async with httpx.AsyncClient() as client:
        r = await post(client, gw.url, {"model": "m", "prompt": "x", "stream": True}, headers=auth)
    assert pod.seen[0].body["stream_options"] == {"include_usage": True}
    assert '"usage": {' not in r.text
    assert r.text.endswith("data: [DONE]\n\n")
    key = gw.gateway.keys.lookup("sk-batch-secret-22", 0.0)
    assert key.limiter.tokens.level == pytest.approx(600 - 15, abs=1)
