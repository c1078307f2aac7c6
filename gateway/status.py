"""Writes what the gateway knows about a service into its status: the circuit breaker's state
(and the fallback in use while it is not closed), since when requests wait for a ready pod
(the autoscaler's cue to scale from zero), and a ModelNameConflict condition while another
service claims the same model name.

Applied server-side under the field manager ``ladle-gateway``, into ``status.gateway`` and that
one condition only, so the operator's fields are never touched and the operator never touches
these (it compares its own status without them). Writes are
coalesced per service and sent off the data path; with two gateway replicas, the status shows
the most recent transition either of them saw (each replica's own view is in its metrics).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from ladle.api import API_VERSION, ISVC_KIND, JSON, rfc3339
from ladle.gateway.breaker import State
from ladle.gateway.routes import Conflict, RouteTable, ServiceKey
from ladle.gateway.service_state import ServiceState
from ladle.kube import REQUEST_ERRORS, ApiError, KubeClient

log = logging.getLogger("ladle.gateway.status")

FIELD_MANAGER = "ladle-gateway"
CONFLICT_CONDITION = "ModelNameConflict"
MIN_INTERVAL = 1.0  # seconds between writes to one service


def gateway_status(
    state: ServiceState, transitioned_at: float, held_at: float | None, reporter: str
) -> JSON:
    """The ``status.gateway`` block for one service."""
    breaker = state.breaker
    block: dict[str, Any] = {
        "breaker": {
            "state": breaker.state.value,
            "reason": breaker.reason,
            "lastTransitionTime": rfc3339(transitioned_at),
            "reportedBy": reporter,
        }
    }
    if breaker.state is not State.CLOSED and state.service.fallback:
        block["fallback"] = state.service.fallback
    if held_at is not None:
        block["heldSince"] = rfc3339(held_at)
    return block


def conflict_condition(key: ServiceKey, conflict: Conflict, since: float) -> JSON:
    """The condition both claimants of one model name carry (status True while it lasts)."""
    owner = "/".join(conflict.owner)
    if key == conflict.owner:
        others = ", ".join("/".join(o) for o in conflict.others)
        reason = "KeptByThisService"
        message = (
            f"model {conflict.model!r} is also claimed by {others}; this service, the oldest "
            "claim, keeps it"
        )
    else:
        reason = "RoutedElsewhere"
        message = (
            f"model {conflict.model!r} is also claimed by {owner}, the oldest claim, and the "
            "gateway routes it there: rename it in this service's spec (model.name, or the "
            "adapter's name in adapters)"
        )
    return {
        "type": CONFLICT_CONDITION,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": rfc3339(since),
    }


class StatusWriter:
    def __init__(self, api: KubeClient, reporter: str) -> None:
        self.api = api
        self.reporter = reporter
        self._states: dict[ServiceKey, ServiceState] = {}
        self._transitioned: dict[ServiceKey, float] = {}
        self._held: dict[ServiceKey, float] = {}
        # The conflict each service is in, with when it began.
        self._conflicts: dict[ServiceKey, tuple[Conflict, float]] = {}
        self._pending: set[ServiceKey] = set()
        self._wake = asyncio.Event()
        self.writes = 0

    # -- hooks (called on the event loop by the cluster) ----------------------------------

    def on_transition(self, state: ServiceState, _transition: object) -> None:
        self._transitioned[state.key] = _now()
        self._mark(state)

    def on_hold(self, state: ServiceState) -> None:
        if state.held_since is not None:
            self._held[state.key] = _now()
        else:
            self._held.pop(state.key, None)
        self._mark(state)

    def on_new(self, state: ServiceState) -> None:
        """A service this replica has not seen: correct a stale non-closed state left by a
        gateway that is gone (ours starts closed)."""
        reported = state.service.reported_breaker
        if reported is not None and reported != state.breaker.state.value:
            self._transitioned[state.key] = _now()
            self._mark(state)

    def on_table(self, table: RouteTable, states: Mapping[ServiceKey, ServiceState]) -> None:
        """Mark services whose model-name conflict began, changed or ended."""
        for key in self._conflicts.keys() | {
            k for c in table.conflicts.values() for k in (c.owner, *c.others)
        }:
            conflict = table.conflict_of(key)
            known = self._conflicts.get(key)
            if (known[0] if known else None) == conflict:
                continue
            if conflict is None:
                del self._conflicts[key]
            else:
                self._conflicts[key] = (conflict, _now())
            state = states.get(key)
            if state is not None:
                self._mark(state)

    def _mark(self, state: ServiceState) -> None:
        self._states[state.key] = state
        self._pending.add(state.key)
        self._wake.set()

    # -- the writer task ------------------------------------------------------------------

    async def run(self) -> None:
        last: dict[ServiceKey, float] = {}
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            for key in sorted(self._pending):
                wait = MIN_INTERVAL - (loop.time() - last.get(key, -MIN_INTERVAL))
                if wait > 0:
                    loop.call_later(wait, self._wake.set)
                    continue
                self._pending.discard(key)
                last[key] = loop.time()
                if not await self._write(key):
                    self._pending.add(key)
                    loop.call_later(MIN_INTERVAL * 2, self._wake.set)

    async def _write(self, key: ServiceKey) -> bool:
        state = self._states[key]
        namespace, name = key
        status: JSON = {
            "gateway": gateway_status(
                state, self._transitioned.get(key, _now()), self._held.get(key), self.reporter
            )
        }
        conflict = self._conflicts.get(key)
        if conflict is not None:
            status["conditions"] = [conflict_condition(key, *conflict)]
        body = {
            "apiVersion": API_VERSION,
            "kind": ISVC_KIND,
            "metadata": {"name": name, "namespace": namespace},
            "status": status,
        }
        try:
            await self.api.apply(body, subresource="status")
        except ApiError as err:
            if err.status == 404:
                return True  # deleted meanwhile
            log.warning(
                "status write failed", extra={"service": f"{namespace}/{name}", "error": str(err)}
            )
            return False
        except REQUEST_ERRORS as err:
            log.warning(
                "status write failed", extra={"service": f"{namespace}/{name}", "error": str(err)}
            )
            return False
        self.writes += 1
        return True


def _now() -> float:
    return time.time()
