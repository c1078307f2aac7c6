"""Leader election's own guarantees, on its own: a term ends at its deadline, hung request or not,
and no write leaves after it. (tests/operator/test_ha.py proves the same against the cluster.)"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import kopf
import pytest
from aiohttp import web

from ladle.kube import Fenced, KubeClient
from ladle.operator.leader import ElectionTiming, LeaderElector, LeadershipLost

TIMING = ElectionTiming(lease_seconds=3, renew_deadline_seconds=1.0, retry_seconds=0.2)


class LeaseServer:
    """Just enough of a Lease endpoint: it answers at once until told to hang."""

    def __init__(self) -> None:
        self.lease: dict[str, Any] | None = None
        self.hang = asyncio.Event()
        # Seconds each write takes to answer, and when the last one arrived (monotonic).
        self.write_delay = 0.0
        self.written_at = 0.0

    async def handle(self, request: web.Request) -> web.Response:
        if self.hang.is_set():
            await asyncio.sleep(3600)
        if request.method == "GET":
            if self.lease is None:
                return web.json_response({"reason": "NotFound", "message": "no"}, status=404)
            return web.json_response(self.lease)
        if request.method in ("POST", "PUT"):
            self.written_at = time.monotonic()
            self.lease = await request.json()
            await asyncio.sleep(self.write_delay)
            return web.json_response(self.lease)
        return web.json_response({})


@pytest.fixture
async def server() -> Any:
    lease = LeaseServer()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", lease.handle)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield lease, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def client(url: str, **kwargs: Any) -> KubeClient:
    return KubeClient("test", lambda: kopf.ConnectionInfo(server=url), **kwargs)


async def test_the_term_runs_from_when_the_winning_request_was_sent(server: Any) -> None:
    """A standby counts the lease from the write it saw; the leader must count its own term
    from before it sent that write, never from when the slow answer came back."""
    lease, url = server
    lease.write_delay = TIMING.attempt_seconds / 2
    lease_client = client(url, timeout_seconds=60)
    try:
        elector = LeaderElector(lease_client, "ns", "lease", "me", TIMING)
        await elector.acquire()
    finally:
        await lease_client.close()
    assert elector.valid_until <= lease.written_at + TIMING.renew_deadline_seconds


async def test_a_renewal_that_hangs_ends_the_term_at_the_deadline(server: Any) -> None:
    """Only the Lease request hangs (everything else would work): the leader must stop at its
    renew deadline, not when the hung request returns or times out."""
    lease, url = server
    lease_client = client(url, timeout_seconds=60)
    elector = LeaderElector(lease_client, "ns", "lease", "me", TIMING)
    await elector.acquire()
    assert elector.is_leader
    holding = asyncio.create_task(elector.hold())
    await asyncio.sleep(0.5)
    assert elector.is_leader
    assert not holding.done()

    lease.hang.set()
    hung_at = time.monotonic()
    # Lost long before the hung request's 60 s timeout could have ended the wait.
    with pytest.raises(LeadershipLost):
        await asyncio.wait_for(holding, timeout=30)
    # The term ended one renew deadline after the last renewal began, which was before the hang
    # (the elector's own clock readings: no scheduling slack to allow for), and not before.
    assert elector.valid_until <= hung_at + TIMING.renew_deadline_seconds
    assert not elector.is_leader
    assert elector.valid_until <= time.monotonic()
    await lease_client.close()


async def test_no_write_leaves_after_the_term_and_one_in_flight_is_cut_off(
    server: Any,
) -> None:
    lease, url = server
    deadline = time.monotonic() + 0.5
    writer = client(url, fence=lambda: deadline)
    await writer.create("/api/v1/namespaces/ns/events", {"kind": "Event"})  # within the term

    lease.hang.set()  # the API server stops answering mid-write
    started = time.monotonic()
    with pytest.raises(Fenced):
        await writer.create("/api/v1/namespaces/ns/events", {"kind": "Event"})
    assert time.monotonic() - started < 30  # cut off at the deadline, not the 60 s timeout
    lease.hang.clear()
    with pytest.raises(Fenced):  # after the deadline nothing is even sent
        await writer.create("/api/v1/namespaces/ns/events", {"kind": "Event"})
    assert await writer.get("/anything") is not None  # reads are not fenced
    await writer.close()


def test_timings_that_would_allow_two_leaders_are_refused() -> None:
    with pytest.raises(ValueError, match="renew deadline < lease duration"):
        ElectionTiming(lease_seconds=10, renew_deadline_seconds=10, retry_seconds=2)
