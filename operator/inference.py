"""The InferenceService reconciler: plan → rollout → grant → desired children → apply →
status.

One reconcile recomputes everything from the store, whatever event caused it (level-based).
Each variant (stable, and a canary while one runs) is planned once: its blueprint (the pod
template it runs) beside its live Deployment, which says whether its rollout is due. The
rollout state machine (``rollout.decide``) picks up where ``status.rollout`` left off, on what
the canary analysis measured; the pool grants replicas for the state it decided, which
``desired.variant_replicas`` shares among the variants; each variant's children come from its
blueprint, the Service fronts them all; the applier makes them so; and status is derived from
what the store then holds. Events and metrics of the decision follow the status write.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ladle.api import (
    API_VERSION,
    CANARY,
    HTTP_ROUTE_KIND,
    ISVC_KIND,
    JSON,
    ROLLOUT_ACTION_ANNOTATION,
    ROLLOUT_ACTIONS,
    STABLE,
    GPUPoolSpec,
    InferenceService,
    rfc3339,
)
from ladle.kube import ApiError, KubeClient, resource_path
from ladle.operator.adapter_status import AdaptersObservation, observe, read_pods
from ladle.operator.applier import ChildApplier, ChildConflict, Owner, SyncResult, child_key
from ladle.operator.canary import CanaryAnalysis, Measured
from ladle.operator.conditions import ISVC_CONDITIONS, ISVC_STATUS_FIELDS
from ladle.operator.config import OperatorConfig
from ladle.operator.desired import (
    Blueprint,
    blueprint,
    children_of,
    group_children,
    label_selector,
    refusal,
    service_url,
    template_hash,
    variant_name,
    variant_replicas,
    variant_sources,
)
from ladle.operator.events import EventRecorder, ObjectRef
from ladle.operator.gaie import GaieChildren
from ladle.operator.pod_events import PodEvents
from ladle.operator.pools import Grant, PoolReconciler
from ladle.operator.revisions import revision_of, template_of
from ladle.operator.rollout import decide
from ladle.operator.rollout_machine import Decision, Observation
from ladle.operator.rollout_state import RolloutState, from_status, split
from ladle.operator.runtime_flags import profiling
from ladle.operator.service_objects import desired_service, group_secret
from ladle.operator.status import Problem, VariantObservation, derive_isvc_status, read_rollout
from ladle.operator.status_writer import StatusWriter
from ladle.operator.store import PodInfo, Store
from ladle.operator.telemetry import Metrics

log = logging.getLogger("ladle.operator.inference")

IsvcKey = tuple[str, str]
# Whom a service's adapter read asked: each variant's adapters, and the pods.
AdapterAsk = tuple[tuple[tuple[str, tuple[str, ...]], ...], tuple[str, ...]]
# Children that come and go with the spec: deleted when no longer desired (a canary's
# Deployment goes when its rollout ends, a group's headless Service when its replicas fit one
# node). A group's workers are not among them: they belong to their leader pod and go with it.
PRUNED_KINDS = ("ConfigMap", "PodDisruptionBudget", "Deployment", "Service", HTTP_ROUTE_KIND)


def isvc_ref(isvc: InferenceService) -> ObjectRef:
    return ObjectRef(API_VERSION, ISVC_KIND, isvc.meta.namespace, isvc.meta.name, isvc.meta.uid)


def apply_problem(key: tuple[str, str, str], err: Exception) -> Problem:
    """A failed apply as a condition: someone else's object, a refusal, or a passing error."""
    if isinstance(err, ChildConflict):
        return Problem("ChildConflict", err.message, stalls=True)
    if isinstance(err, ApiError):
        refused = 400 <= err.status < 500 and err.status not in (409, 429)
        return Problem("ApplyFailed", f"{key[0]} {key[2]}: {err}", stalls=refused)
    return Problem("ApplyFailed", f"{key[0]} {key[2]}: {err}")


def surges(live: JSON | None) -> bool:
    """Whether a live Deployment rolls with a surge replica (a new one does)."""
    rolling = ((live or {}).get("spec") or {}).get("strategy") or {}
    return str((rolling.get("rollingUpdate") or {}).get("maxSurge", 1)) != "0"


def rolling_out(live: JSON | None, wanted: str) -> bool:
    """A rollout of the Deployment is due (a pod template other than the ``wanted`` digest) or
    still under way."""
    if live is None:
        return False
    status = live.get("status") or {}
    if int(status.get("updatedReplicas") or 0) < int(status.get("replicas") or 0):
        return True
    return template_hash(live) != wanted


@dataclass(frozen=True)
class Planned:
    """One variant of one rollout state: its blueprint, its share of traffic, and its live
    Deployment."""

    blueprint: Blueprint
    weight: int
    live: JSON | None

    @property
    def name(self) -> str:
        return self.blueprint.variant

    @property
    def current(self) -> bool:
        """The live Deployment was given this blueprint's pod template."""
        return self.live is not None and template_hash(self.live) == self.blueprint.template_hash

    @property
    def rolling(self) -> bool:
        """Its rollout is due or under way and it takes traffic (one that takes none replaces
        its pods without a surge replica)."""
        return self.weight > 0 and rolling_out(self.live, self.blueprint.template_hash)


class InferenceServiceReconciler:
    def __init__(
        self,
        store: Store,
        client: KubeClient,
        applier: ChildApplier,
        pools: PoolReconciler,
        writer: StatusWriter,
        recorder: EventRecorder,
        metrics: Metrics,
        config: OperatorConfig,
        requeue: Callable[[IsvcKey, float], None],
    ) -> None:
        self.store = store
        self.client = client
        self.applier = applier
        self.pools = pools
        self.writer = writer
        self.recorder = recorder
        self.metrics = metrics
        self.config = config
        self.requeue = requeue
        self.canary = CanaryAnalysis(store, client)
        self.pod_events = PodEvents(client)
        # What the pods last said of their adapters, per service: a reconcile that comes
        # before the recheck is due, for the same pods and adapters, does not ask again.
        self._adapter_reads: dict[str, tuple[float, AdapterAsk, AdaptersObservation]] = {}
        # The ladle.dev/profiling problem last announced per service, so that a reconcile
        # repeats no Event (the recorder would count each repeat with an API write).
        self._profiling_said: dict[str, tuple[str, str] | None] = {}
        # Services whose groups' Secret exists (by uid): created once, by the first reconcile.
        self._group_secrets: set[str] = set()
        self.gaie = GaieChildren(store, config)
        # Services deleted since their last reconcile, by key: their uid, forgotten by the
        # next reconcile of the key, which the work queue runs after any one in flight (that
        # one would otherwise export the series of a deleted service again).
        self._deleted: dict[IsvcKey, str] = {}

    def deleted(self, key: IsvcKey, uid: str) -> None:
        self._deleted[key] = uid

    def forget(self, key: IsvcKey, uid: str | None) -> None:
        self.metrics.forget_isvc(*key)
        if uid:
            self.applier.forget(uid)
            self.writer.forget(uid)
            self.canary.forget(uid)
            self._adapter_reads.pop(uid, None)
            self._profiling_said.pop(uid, None)
            self._group_secrets.discard(uid)
        self.pools.forget(key)
        self.metrics.rollouts.pop(key, None)

    def _pool(self, isvc: InferenceService) -> GPUPoolSpec | None:
        if not isvc.spec.gpu_pool:
            return None
        pool = self.store.get("GPUPool", ("", isvc.spec.gpu_pool))
        return pool.spec if pool is not None else None

    def _plan(
        self,
        isvc: InferenceService,
        state: RolloutState,
        known: Mapping[str, Blueprint] | None = None,
    ) -> list[Planned]:
        """Each variant of ``state``; a blueprint already built for the same source (the state
        before the decision, which mostly keeps its variants) is used again."""
        pool = self._pool(isvc)
        out = []
        for name, source, weight in variant_sources(isvc, state):
            bp = (known or {}).get(name)
            if bp is None or bp.source != source:
                bp = blueprint(source, pool, self.config, name)
            key = (isvc.meta.namespace, variant_name(isvc.meta.name, name))
            out.append(Planned(bp, weight, self.store.get("Deployment", key)))
        return out

    def _grant(self, isvc: InferenceService, state: RolloutState, plan: list[Planned]) -> Grant:
        """The pool's grant for ``state``: the service's replicas and the canary's besides."""
        spec = isvc.spec.rollout
        asked = split(state, spec.steps if spec else (100,), isvc.requested_replicas)[1]
        return self.pools.grant(isvc, any(p.rolling for p in plan), asked)

    def desired(
        self,
        isvc: InferenceService,
        state: RolloutState,
        plan: list[Planned],
        grant: Grant,
        pods: list[PodInfo],
        refused: Mapping[str, str | None],
    ) -> list[JSON]:
        """Every child: each variant's (a group's workers among them), then the Service (and
        the InferencePool). A variant about to roll out gets the strategy its pool's headroom
        allows; the others keep the one they have, so that a strategy never changes (and bumps
        a Deployment) for nothing."""
        replicas = variant_replicas(isvc, state, grant.replicas)
        objects: list[JSON] = []
        for p in plan:
            children = children_of(
                p.blueprint,
                replicas[p.name],
                surge=grant.surge if p.rolling else surges(p.live),
                idle=p.weight == 0 and state.active,
                refused=refused[p.name],
            )
            objects += [*children.all(), *group_children(p.blueprint, pods)]
        weights = [(p.name, p.weight) for p in plan]
        available = sum(read_rollout(p.live, 0).available for p in plan)
        gaie = self.gaie.desired(isvc, weights, available)
        return [*objects, desired_service(isvc), *gaie]

    def _observation(
        self,
        isvc: InferenceService,
        state: RolloutState,
        plan: list[Planned],
        measured: Measured,
        now: float,
    ) -> Observation:
        """What the rollout state machine decides on, measured under the state it is in."""
        spec = isvc.spec.rollout
        total = isvc.requested_replicas
        grant = self._grant(isvc, state, plan)
        canary_ready = canary_granted = 0
        stable_complete = False
        for p in plan:
            if p.name == CANARY:
                canary_granted = variant_replicas(isvc, state, grant.replicas)[CANARY]
                live = p.live or {}
                status = live.get("status") or {}
                generation = int((live.get("metadata") or {}).get("generation") or 0)
                settled = int(status.get("observedGeneration") or 0) >= generation
                if (
                    p.current
                    and settled
                    and status.get("updatedReplicas") == status.get("replicas")
                ):
                    canary_ready = int(status.get("availableReplicas") or 0)
            elif p.current:
                stable_complete = read_rollout(p.live, total).complete
        template = template_of(isvc.raw_spec, self.config.runtime_image)
        action = measured.action if measured.action in ROLLOUT_ACTIONS else None
        return Observation(
            now=now,
            revision=revision_of(template),
            template=template,
            rollout=spec,
            total=total,
            canary_ready=canary_ready,
            canary_granted=canary_granted,
            canary_asked=split(state, spec.steps if spec else (100,), total)[1],
            stable_complete=stable_complete,
            action=action,
            quality=measured.quality,
            slo=measured.slo,
            baseline_missing=measured.baseline_missing,
            quota_note=grant.note,
        )

    async def reconcile(self, key: IsvcKey) -> None:
        isvc: InferenceService | None = self.store.get(ISVC_KIND, key)
        gone = self._deleted.pop(key, None)
        if gone is not None and (isvc is None or isvc.meta.uid != gone):
            self.forget(key, gone)
        if isvc is None:
            return
        if isvc.meta.deleting:
            return  # the garbage collector removes the children
        owner = Owner(isvc_ref(isvc), lambda delay: self.requeue(key, delay))
        previous = self.writer.previous(
            isvc.meta.uid, isvc.status, ISVC_STATUS_FIELDS, ISVC_CONDITIONS
        )
        now = round(time.time(), 3)  # status keeps milliseconds
        before = from_status(previous.get("rollout"))
        measured = await self.canary.measure(isvc, before, now)
        planned = self._plan(isvc, before)
        decision = decide(before, self._observation(isvc, before, planned, measured, now))
        state = decision.state

        plan = self._plan(isvc, state, {p.name: p.blueprint for p in planned})
        grant = self._grant(isvc, state, plan)
        blockers = [grant.blocker] if grant.blocker else []
        pods: list[PodInfo] = self.store.by_index("Pod", "owner", isvc.key)
        refused = {p.name: refusal(p.blueprint, p.live, pods) for p in plan}
        result = SyncResult()
        if grant.pool is not None or not isvc.spec.gpu_pool:
            if isvc.spec.parallelism.nodes > 1:
                await self._group_secret(isvc)
            desired = self.desired(isvc, state, plan, grant, pods, refused)
            result = await self.applier.sync(
                owner, desired, (*PRUNED_KINDS, *self.gaie.pruned_kinds)
            )
        blockers += [apply_problem(k, err) for k, err in result.errors]
        await self.canary.follow(isvc, decision)

        adapters = await self._adapters(isvc, plan)
        service = child_key(desired_service(isvc))
        replicas = variant_replicas(isvc, state, grant.replicas)
        observed = [
            await self._observe(isvc, p, replicas[p.name], grant, now, refused[p.name])
            for p in plan
        ]
        variants = [v for v, _ in observed]
        status = derive_isvc_status(
            isvc,
            variants,
            url=self.config.gateway_url or service_url(isvc, self.config.cluster_domain),
            selector=label_selector(isvc.meta.name),
            now=rfc3339(),
            previous=previous,
            blockers=blockers,
            service_exists=self.store.get("Service", service[1:]) is not None,
            service_error=result.create_errors.get(service),
            rollout=state,
            adapters=adapters,
        )
        self.metrics.observe_isvc(*key, status)
        await self.writer.write(owner.ref, status, previous)
        self._announce(isvc, decision)
        self._announce_profiling(isvc)
        if measured.action is not None:
            if not decision.action_used:
                self._refuse_action(isvc, measured.action, state)
            await self.canary.clear_action(isvc)
        # The rollout's next step, or the next look at pods that wait to start.
        wakes = [w for w in (decision.wake_in, *(w for _, w in observed)) if w is not None]
        if adapters is not None:
            wakes.append(adapters.recheck_in)
        if wakes:
            self.requeue(key, min(wakes))
        if result.errors:
            raise result.errors[0][1]  # the work queue retries with backoff

    async def _group_secret(self, isvc: InferenceService) -> None:
        """Create the ranks' shared secret once (never applied: a second apply would change
        it under running groups). The operator never reads it back."""
        if isvc.meta.uid in self._group_secrets:
            return
        secret = group_secret(isvc, secrets.token_hex(32))
        try:
            await self.client.create(resource_path("v1", "Secret", isvc.meta.namespace), secret)
        except ApiError as err:
            if err.status != 409:
                raise
        self._group_secrets.add(isvc.meta.uid)

    async def _adapters(
        self, isvc: InferenceService, plan: list[Planned]
    ) -> AdaptersObservation | None:
        """What the ready pods of each variant that serves adapters say they serve."""
        wanted = {
            p.name: [a.name for a in p.blueprint.source.spec.adapters]
            for p in plan
            if p.blueprint.source.spec.adapters is not None
        }
        if not wanted:
            return None
        pods: list[PodInfo] = self.store.by_index("Pod", "owner", isvc.key)
        asked = [p for p in pods if p.variant in wanted and p.base_url]
        key: AdapterAsk = (
            tuple((v, tuple(names)) for v, names in sorted(wanted.items())),
            tuple(sorted(p.name for p in asked)),
        )
        now = time.monotonic()
        last = self._adapter_reads.get(isvc.meta.uid)
        if last is not None and last[1] == key and now < last[0] + last[2].recheck_in:
            return last[2]
        seen = observe(wanted, await read_pods(asked))
        self._adapter_reads[isvc.meta.uid] = (now, key, seen)
        return seen

    def _announce(self, isvc: InferenceService, decision: Decision) -> None:
        """Events and metrics for what the decision did, once its status is written."""
        ref = isvc_ref(isvc)
        for event in decision.events:
            self.recorder.emit(ref, event.type, event.reason, event.message)
        labels = (isvc.meta.namespace, isvc.meta.name)
        for gate, result in decision.analysed:
            self.metrics.analyses.labels(*labels, gate, result).inc()
        if decision.rolled_back is not None:
            self.metrics.rollbacks.labels(*labels, decision.rolled_back).inc()
        self.metrics.rollouts[isvc.key] = decision.state

    def _announce_profiling(self, isvc: InferenceService) -> None:
        """A Warning Event when ladle.dev/profiling asks for what cannot be, once per change."""
        problem = profiling(isvc).problem
        if self._profiling_said.get(isvc.meta.uid) == problem:
            return
        self._profiling_said[isvc.meta.uid] = problem
        if problem is not None:
            self.recorder.emit(isvc_ref(isvc), "Warning", *problem)

    def _refuse_action(self, isvc: InferenceService, action: str, state: RolloutState) -> None:
        if action not in ROLLOUT_ACTIONS:
            why = f"unknown action {action!r}: use one of {', '.join(ROLLOUT_ACTIONS)}"
        elif state.stage in ("Promoting", "Finalizing"):
            why = f"{action}: the rollout is already {state.stage.lower()}"
        else:
            why = f"{action}: there is nothing to {action} (rollout phase {state.phase})"
        self.recorder.emit(
            isvc_ref(isvc), "Warning", "RolloutActionIgnored", f"{ROLLOUT_ACTION_ANNOTATION} {why}"
        )

    async def _observe(
        self,
        isvc: InferenceService,
        p: Planned,
        replicas: int,
        grant: Grant,
        now: float,
        refused: str | None,
    ) -> tuple[VariantObservation, float | None]:
        """One variant as status reads it, and when its waiting pods want another look."""
        name = variant_name(isvc.meta.name, p.name)
        pods: list[PodInfo] = [
            pod for pod in self.store.by_index("Pod", "owner", isvc.key) if pod.variant == p.name
        ]
        source = p.blueprint.source
        stable = p.name == STABLE
        problems, wake_in = await self.pod_events.problems(isvc.meta.namespace, pods, now)
        return VariantObservation(
            name=p.name,
            quantization=source.spec.quantization.label(),
            image=source.spec.runtime_image or self.config.runtime_image,
            deployment_name=name,
            # Read again: the apply above stored what the API server returned.
            deployment=self.store.get("Deployment", (isvc.meta.namespace, name)),
            requested_replicas=isvc.requested_replicas if stable else replicas,
            granted_replicas=0 if refused is not None else replicas,
            gpu_resource=grant.gpu_resource,
            pod_problems=tuple(problems),
            quota_note=grant.note if stable else None,
            weight=p.weight,
            revision=revision_of(template_of(source.raw_spec, self.config.runtime_image)),
            refused=refused,
        ), wake_in
