"""Server-side apply of an owner's children: digest skip, conflict policy, drift, pruning.

``sync(owner, desired, prune)`` makes an owner's children exactly ``desired``, whatever they
are (one variant's Deployment today; canary Deployments and per-variant Services tomorrow):

- **Digest skip.** A child is applied only if its desired form changed since the last apply,
  or the live object moved away from it: its spec (generation, or resourceVersion for kinds
  without one) or the labels, annotations and owner reference the operator sets.
- **Conflict policy.** An object of a child's name that someone else made is never taken over
  (``ChildConflict``). The watch sees only the operator's own children, so before the first
  apply of a child it has not seen the applier reads it: an object that is not owned by this
  owner is left alone. (Server-side apply alone would not do: it merges into another
  manager's object whenever their fields do not collide.) Deployments skip that read, which
  would sit on the path from a new InferenceService to its pods: their selector is immutable,
  so an unforced apply onto someone else's Deployment is refused (a conflict, or an immutable
  selector) and never merged. Once seen, applies are forced: the operator owns those fields.
- **Slow creates in the background.** The API server allocates ClusterIPs one at a time, so a
  Service create can take seconds under load; it runs beside the reconcile, which sees it as
  pending, and failures back off exponentially.
- **Drift, told apart.** A child that vanished from the watch is either deleted (it is
  recreated: a ``Restored`` event) or relabelled out of the operator's selector (the same
  object comes back: ``Reverted``). Edits by someone else are reverted with a ``Reverted``
  event.
- **Pruning.** Children of the kinds in ``prune`` that the owner no longer wants are deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any

from ladle.api import (
    HTTP_ROUTE_API_VERSION,
    HTTP_ROUTE_KIND,
    INFERENCE_POOL_API_VERSION,
    INFERENCE_POOL_KIND,
    JSON,
    MODEL_REWRITE_API_VERSION,
    MODEL_REWRITE_KIND,
)
from ladle.kube import REQUEST_ERRORS, ApiError, KubeClient, resource_path
from ladle.operator.desired import object_digest
from ladle.operator.events import EventRecorder, ObjectRef
from ladle.operator.store import Store, child_version, trim_child
from ladle.operator.telemetry import Metrics

log = logging.getLogger("ladle.operator.applier")

ChildKey = tuple[str, str, str]  # (kind, namespace, name)
# Kinds created before the others: pods mount them.
FIRST_KINDS = ("ConfigMap",)
# Kinds whose creates run in the background.
BACKGROUND_CREATE_KINDS = frozenset({"Service"})
# Kinds an unforced apply can never merge into someone else's object: an immutable selector.
REFUSE_FOREIGN_KINDS = frozenset({"Deployment"})
BACKGROUND_CREATES = 8
API_VERSIONS = {
    "Deployment": "apps/v1",
    "StatefulSet": "apps/v1",
    "Service": "v1",
    "ConfigMap": "v1",
    "PodDisruptionBudget": "policy/v1",
    INFERENCE_POOL_KIND: INFERENCE_POOL_API_VERSION,
    HTTP_ROUTE_KIND: HTTP_ROUTE_API_VERSION,
    MODEL_REWRITE_KIND: MODEL_REWRITE_API_VERSION,
}


class ChildConflict(ApiError):
    """A child's name is held by an object the operator did not make."""


def child_key(obj: Mapping[str, Any]) -> ChildKey:
    meta = obj["metadata"]
    return (str(obj["kind"]), str(meta["namespace"]), str(meta["name"]))


def metadata_drift(desired: Mapping[str, Any], live: Mapping[str, Any]) -> list[str]:
    """What of the metadata the operator sets is missing or different on the live object."""
    want = desired.get("metadata") or {}
    have = live.get("metadata") or {}
    drift = []
    for field_name in ("labels", "annotations"):
        ours = want.get(field_name) or {}
        theirs = have.get(field_name) or {}
        drift += [f"{field_name[:-1]} {k}" for k, v in ours.items() if theirs.get(k) != v]
    live_owners = {ref.get("uid") for ref in have.get("ownerReferences") or ()}
    if any(ref.get("uid") not in live_owners for ref in want.get("ownerReferences") or ()):
        drift.append("owner reference")
    return drift


@dataclass(frozen=True)
class Owner:
    """The object children belong to, and how to look at it again."""

    ref: ObjectRef
    # Queue the owner's reconcile again after this many seconds (0: now).
    requeue: Callable[[float], None]


@dataclass
class Record:
    """What the operator last applied to a child."""

    owner: str  # the owner's uid
    digest: str
    version: str
    uid: str
    # The metadata it set (labels, annotations, owner reference), to tell drift from edits.
    metadata: JSON


@dataclass(frozen=True)
class CreateFailure:
    """Why a background create failed, and when to try again."""

    owner: str
    message: str
    failures: int
    retry_at: float  # time.monotonic()


@dataclass(frozen=True)
class SyncResult:
    # Children being created in the background.
    pending: frozenset[ChildKey] = frozenset()
    # The last failed background create of each child, in the API server's words.
    create_errors: Mapping[ChildKey, str] = field(default_factory=dict)
    # Applies that failed this time.
    errors: tuple[tuple[ChildKey, Exception], ...] = ()


class ChildApplier:
    def __init__(
        self,
        client: KubeClient,
        store: Store,
        recorder: EventRecorder,
        metrics: Metrics,
        backoff: Callable[[int], float],
    ) -> None:
        self.client = client
        self.store = store
        self.recorder = recorder
        self.metrics = metrics
        self.backoff = backoff
        self.records: dict[ChildKey, Record] = {}
        self.failures: dict[ChildKey, CreateFailure] = {}
        self.creating: dict[ChildKey, asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(BACKGROUND_CREATES)
        self._spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]] | None = None

    def start(self, spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]) -> None:
        """Where background creates run (the controller's task group)."""
        self._spawn = spawn

    def forget(self, owner_uid: str) -> None:
        """Drop everything remembered about an owner's children (the owner is gone)."""
        for table in (self.records, self.failures):
            for key in [k for k, v in table.items() if v.owner == owner_uid]:
                del table[key]

    async def sync(
        self, owner: Owner, desired: list[JSON], prune: Collection[str] = ()
    ) -> SyncResult:
        first = [c for c in desired if c["kind"] in FIRST_KINDS]
        rest = [c for c in desired if c["kind"] not in FIRST_KINDS]
        errors: list[tuple[ChildKey, Exception]] = []
        for child in first:
            try:
                await self._ensure(owner, child)
            except REQUEST_ERRORS as err:
                errors.append((child_key(child), err))
        if errors:  # pods would mount a ConfigMap that is not right
            return SyncResult(errors=tuple(errors))
        inline = []
        for child in rest:
            key = child_key(child)
            unknown = self.store.get(key[0], key[1:]) is None and key not in self.records
            if child["kind"] in BACKGROUND_CREATE_KINDS and unknown:
                self._create_in_background(owner, child)
            else:
                inline.append(child)
        results = await asyncio.gather(
            *(self._ensure(owner, c) for c in inline), return_exceptions=True
        )
        for child, result in zip(inline, results, strict=True):
            if isinstance(result, REQUEST_ERRORS):
                errors.append((child_key(child), result))
            elif isinstance(result, BaseException):
                raise result
        wanted = {child_key(c) for c in desired}
        for kind in prune:
            await self._prune(owner, kind, wanted)
        keys = wanted | {k for k, f in self.failures.items() if f.owner == owner.ref.uid}
        return SyncResult(
            pending=frozenset(k for k in keys if k in self.creating),
            create_errors={k: f.message for k, f in self.failures.items() if k in wanted},
            errors=tuple(errors),
        )

    async def _prune(self, owner: Owner, kind: str, wanted: set[ChildKey]) -> None:
        namespace, name = owner.ref.namespace, owner.ref.name
        live = {
            child_key(c)
            for c in self.store.by_index(kind, "owner", (namespace, name))
            if any(r.get("uid") == owner.ref.uid for r in c["metadata"].get("ownerReferences", ()))
        }
        remembered = {
            k for k, r in self.records.items() if k[0] == kind and r.owner == owner.ref.uid
        }
        for key in sorted((live | remembered) - wanted):
            await self.client.delete(resource_path(API_VERSIONS[kind], kind, key[1], key[2]))
            self.records.pop(key, None)

    def _create_in_background(self, owner: Owner, obj: JSON) -> None:
        key = child_key(obj)
        if key in self.creating or self._spawn is None:
            return
        failure = self.failures.get(key)
        if failure is not None and time.monotonic() < failure.retry_at:
            owner.requeue(failure.retry_at - time.monotonic())
            return

        async def create() -> None:
            try:
                async with self._slots:  # a storm of creates only slows each one down
                    await self._ensure(owner, obj)
                self.failures.pop(key, None)
            except REQUEST_ERRORS as err:
                failures = failure.failures + 1 if failure is not None else 1
                delay = self.backoff(failures)
                log.warning(
                    "could not create a child; will retry",
                    extra={"child": "/".join(key), "error": str(err), "retry_in": delay},
                )
                self.failures[key] = CreateFailure(
                    owner.ref.uid, str(err), failures, time.monotonic() + delay
                )
            finally:
                self.creating.pop(key, None)
                owner.requeue(0)  # its status says Ready, or why not

        self.creating[key] = self._spawn(create(), f"create-{'/'.join(key)}")

    async def _ensure(self, owner: Owner, obj: JSON) -> None:
        """Apply one child unless the live object is exactly what was last applied."""
        key = child_key(obj)
        digest = object_digest(obj)
        record = self.records.get(key)
        live = self.store.get(key[0], key[1:])
        drift = metadata_drift({"metadata": record.metadata}, live) if record and live else []
        if (
            record is not None
            and live is not None
            and record.digest == digest
            and child_version(live) == record.version
            and not drift
        ):
            return
        if live is None and record is not None and not await self._still_owned(owner):
            return  # the owner is being deleted: recreating its children would leak them
        unseen = live is None and record is None
        if unseen and key[0] not in REFUSE_FOREIGN_KINDS:
            await self._check_unseen(owner, key)
        touched = self.store.touched(key[0], key[1:])
        try:
            result = await self.client.apply(obj, force=not unseen)
        except ApiError as err:
            refused = err.status == 409 or (err.status == 422 and "immutable" in err.message)
            if unseen and refused:
                raise ChildConflict(
                    409, f"{key[0]} {key[2]} exists and is not ours: {err.message}", err.reason
                ) from err
            raise
        self.metrics.applies.labels(key[0]).inc()
        uid = str(result["metadata"].get("uid", ""))
        meta = obj["metadata"]
        applied = {k: meta[k] for k in ("labels", "annotations", "ownerReferences") if k in meta}
        self.records[key] = Record(owner.ref.uid, digest, child_version(result), uid, applied)
        if self.store.touched(key[0], key[1:]) == touched:
            # The answer is fresher than the cache, so status need not wait for the watch. If
            # an event arrived meanwhile, it may be newer still: then the watch has the say.
            self.store.upsert(key[0], key[1:], trim_child(result))
        self._announce(owner, key, record, live, result, drift)

    def _announce(
        self,
        owner: Owner,
        key: ChildKey,
        record: Record | None,
        live: Mapping[str, Any] | None,
        result: Mapping[str, Any],
        drift: list[str],
    ) -> None:
        what = f"{key[0]} {key[2]}"
        if record is None:
            return  # new to this leader: nothing to tell
        if live is None:
            if record.uid and record.uid == result["metadata"].get("uid"):
                self.recorder.emit(
                    owner.ref,
                    "Normal",
                    "Reverted",
                    f"Put back the labels of {what}, which were changed outside the operator "
                    "and hid it from the operator's selector",
                )
            else:
                self.recorder.emit(
                    owner.ref,
                    "Normal",
                    "Restored",
                    f"Recreated {what}, which was deleted outside the operator",
                )
        elif drift or child_version(result) != child_version(live):
            if record.version == child_version(live) and not drift:
                return  # our own spec change, not someone else's
            detail = f" ({', '.join(drift)})" if drift else ""
            self.recorder.emit(
                owner.ref,
                "Normal",
                "Reverted",
                f"Reverted changes made to {what} outside the operator{detail}",
            )

    async def _check_unseen(self, owner: Owner, key: ChildKey) -> None:
        """Raise ChildConflict if an object of this child's name exists and is not the
        owner's (one that is, the watch simply has not delivered yet)."""
        existing = await self.client.get(resource_path(API_VERSIONS[key[0]], *key))
        if existing is None:
            return
        meta = existing.get("metadata") or {}
        if any(
            ref.get("uid") == owner.ref.uid and ref.get("controller")
            for ref in meta.get("ownerReferences") or ()
        ):
            return
        managers = sorted({str(f.get("manager")) for f in meta.get("managedFields") or ()})
        made_by = f" (managed by {', '.join(managers)})" if managers else ""
        raise ChildConflict(409, f"{key[0]} {key[2]} exists and is not ours{made_by}", "Conflict")

    async def _still_owned(self, owner: Owner) -> bool:
        """Before recreating a vanished child, check the owner was not deleted meanwhile."""
        ref = owner.ref
        fresh = await self.client.get(
            resource_path(ref.api_version, ref.kind, ref.namespace, ref.name)
        )
        meta = (fresh or {}).get("metadata") or {}
        return meta.get("uid") == ref.uid and not meta.get("deletionTimestamp")
