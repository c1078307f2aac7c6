"""The canary analysis' I/O: pod metrics at both ends of each interval, the quality gate's
online ``ladle eval``, and the rollout-action annotation. Decisions are ``rollout.decide``'s and
the arithmetic ``analysis``'s; this module only measures and remembers.

What lives here is in memory, per leadership term, and nothing depends on it surviving: a new
leader finds no baseline for the interval under way and starts that interval again
(``Observation.baseline_missing``), and finds no quality check running and starts one.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from ladle.api import (
    API_VERSION,
    CANARY,
    ISVC_KIND,
    ROLLOUT_ACTION_ANNOTATION,
    STABLE,
    InferenceService,
)
from ladle.kube import REQUEST_ERRORS, ApiError, KubeClient, resource_path
from ladle.operator.analysis import (
    PodTotals,
    QualityNumbers,
    interval,
    parse_metrics,
    quality_checks,
    quality_outcome,
    slo_gates,
    sum_pods,
)
from ladle.operator.rollout_machine import Decision
from ladle.operator.rollout_state import GateOutcome, QualityVerdict, RolloutState
from ladle.operator.store import PodInfo, Store

if TYPE_CHECKING:
    from ladle.runtime.eval.online import Answers

log = logging.getLogger("ladle.operator.canary")

SCRAPE_TIMEOUT_SECONDS = 3.0
EVAL_TIMEOUT_SECONDS = 120.0
# Teacher-forced over each position's top 20, and the first 16 greedy tokens compared.
EVAL_TOP_K = 20
EVAL_GREEDY_TOKENS = 16

Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]]
IntervalKey = tuple[str | None, int, int | None]
# The stable's answers hold while its revision, the model asked and the prompts do.
ReferenceKey = tuple[str | None, str, str | None]


@dataclass(frozen=True)
class Scrape:
    """Both variants' pods, scraped at one moment (pods that did not answer are missing)."""

    at: float
    stable: Mapping[str, PodTotals]
    canary: Mapping[str, PodTotals]


@dataclass(frozen=True)
class Baseline:
    key: IntervalKey
    scrape: Scrape


@dataclass(frozen=True)
class Measured:
    """What this reconcile measured for ``rollout.decide``."""

    action: str | None = None
    slo: tuple[GateOutcome, ...] | None = None
    baseline_missing: bool = False
    quality: QualityVerdict | None = None


def interval_key(state: RolloutState) -> IntervalKey:
    """Which interval a baseline belongs to. Its start is compared in whole milliseconds, as
    status keeps it: the state a decision made and the one read back from status must match."""
    started = state.interval_started
    return (state.canary_revision, state.step, None if started is None else round(started * 1000))


def read_action(isvc: InferenceService) -> str | None:
    value = isvc.meta.annotations.get(ROLLOUT_ACTION_ANNOTATION)
    return value.strip().lower() if value is not None else None


def _quality_numbers(result: Any) -> QualityNumbers:
    return QualityNumbers(
        top1=float(result.top1_agreement),
        kld=float(result.kld_mean),
        ppl_increase=float(result.ppl_delta),
        greedy=float(result.greedy_agreement),
        prompts=int(result.num_prompts),
        tokens=int(result.num_tokens),
    )


def run_eval(
    stable_url: str,
    canary_url: str,
    model: str,
    prompts_name: str | None,
    prompts: str | None,
    reference: Answers | None = None,
) -> tuple[QualityNumbers, Answers]:
    """Online ``ladle eval`` (blocking: run it in a thread): the canary's numbers, and the
    stable's answers, which a later step against the same stable passes back as
    ``reference`` instead of asking the stable again. Raises EvalError or PromptFileError with
    a message that says what went wrong."""
    from ladle.runtime.eval.online import Endpoint, collect_pair, compare
    from ladle.runtime.eval.prompts import load_prompts, parse_prompts

    if prompts is None:
        loaded = load_prompts()
    else:
        # The key's suffix says the format (.json, .jsonl, or one prompt per line).
        loaded = parse_prompts(prompts, Path(prompts_name or "prompts.txt"))
    stable, canary = collect_pair(
        reference or Endpoint(stable_url, model=model),
        Endpoint(canary_url, model=model),
        loaded,
        top_k=EVAL_TOP_K,
        greedy_tokens=EVAL_GREEDY_TOKENS,
        timeout=EVAL_TIMEOUT_SECONDS,
    )
    return _quality_numbers(compare(stable, canary, loaded)), stable


class CanaryAnalysis:
    def __init__(self, store: Store, client: KubeClient) -> None:
        self.store = store
        self.client = client
        self._spawn: Spawn | None = None
        self._requeue: Callable[[tuple[str, str]], None] = lambda _key: None
        self._baselines: dict[str, Baseline] = {}
        # The scrape that ended an interval this reconcile: the next interval's baseline.
        self._latest: dict[str, Scrape] = {}
        self._running: dict[str, tuple[str, int]] = {}
        self._verdicts: dict[str, QualityVerdict] = {}
        # The action annotation this leader acted on and removed, until the store shows it gone:
        # a reconcile that runs on the status write's event still sees it.
        self._cleared: dict[str, str] = {}
        # The stable's answers to the quality gate's prompts, for the steps after the first.
        self._references: dict[str, dict[ReferenceKey, Answers]] = {}

    def start(self, spawn: Spawn, requeue: Callable[[tuple[str, str]], None]) -> None:
        self._spawn = spawn
        self._requeue = requeue

    def forget(self, uid: str) -> None:
        tables = (self._baselines, self._latest, self._running, self._verdicts, self._cleared)
        for table in (*tables, self._references):
            table.pop(uid, None)

    # ---- measuring

    def _pods(self, isvc: InferenceService, variant: str) -> list[PodInfo]:
        pods: list[PodInfo] = self.store.by_index("Pod", "owner", isvc.key)
        return [p for p in pods if p.variant == variant and p.base_url]

    async def _scrape_pods(
        self, http: httpx.AsyncClient, pods: Sequence[PodInfo]
    ) -> dict[str, PodTotals]:
        async def one(pod: PodInfo) -> tuple[str, PodTotals | None]:
            try:
                response = await http.get(f"{pod.base_url}/metrics")
                response.raise_for_status()
                return pod.name, parse_metrics(response.text)
            except (httpx.HTTPError, ValueError) as err:
                log.info("could not scrape a pod", extra={"pod": pod.name, "error": str(err)})
                return pod.name, None

        results = await asyncio.gather(*(one(p) for p in pods))
        return {name: metrics for name, metrics in results if metrics is not None}

    async def scrape(self, isvc: InferenceService) -> Scrape:
        async with httpx.AsyncClient(timeout=SCRAPE_TIMEOUT_SECONDS) as http:
            stable, canary = await asyncio.gather(
                self._scrape_pods(http, self._pods(isvc, STABLE)),
                self._scrape_pods(http, self._pods(isvc, CANARY)),
            )
        return Scrape(time.time(), stable, canary)

    async def measure(self, isvc: InferenceService, state: RolloutState, now: float) -> Measured:
        """The SLO verdict of an interval that has ended, a finished quality check, and the
        action annotation."""
        uid = isvc.meta.uid
        self._latest.pop(uid, None)
        spec = isvc.spec.rollout
        slo = None
        missing = False
        if spec is not None and state.stage == "Analysing" and state.interval_started is not None:
            base = self._baselines.get(uid)
            if base is None or base.key != interval_key(state):
                missing = True
            elif now >= state.interval_started + spec.interval_seconds:
                end = await self.scrape(isvc)
                self._latest[uid] = end
                began = base.scrape.at
                canary = interval(base.scrape.canary, end.canary, began)
                if state.weight >= 100:
                    # Stable takes no traffic at a 100% step: its pods' whole lifetime (the
                    # earlier steps included) is the reference, which any leader can read.
                    stable = sum_pods(list(end.stable.values()))
                else:
                    stable = interval(base.scrape.stable, end.stable, began)
                slo = slo_gates(canary, stable, spec.slo, spec.min_requests)
        return Measured(self._action(isvc), slo, missing, self._verdicts.pop(uid, None))

    def _action(self, isvc: InferenceService) -> str | None:
        """The action annotation, unless it is the one this leader already removed."""
        uid = isvc.meta.uid
        value = isvc.meta.annotations.get(ROLLOUT_ACTION_ANNOTATION)
        if value is None:
            self._cleared.pop(uid, None)
            return None
        if self._cleared.get(uid) == value:
            return None
        return read_action(isvc)

    # ---- after a decision

    async def follow(self, isvc: InferenceService, decision: Decision) -> None:
        """Take the baseline of an interval that starts, and start a quality check wanted."""
        uid, state = isvc.meta.uid, decision.state
        if not state.active:
            self.forget(uid)
            return
        if decision.new_interval:
            scrape = self._latest.pop(uid, None) or await self.scrape(isvc)
            self._baselines[uid] = Baseline(interval_key(state), scrape)
        if decision.run_quality:
            self._start_quality(isvc, state)

    def _start_quality(self, isvc: InferenceService, state: RolloutState) -> None:
        uid = isvc.meta.uid
        assert state.canary_revision is not None
        key = (state.canary_revision, state.step)
        if self._running.get(uid) == key or self._spawn is None:
            return
        self._running[uid] = key
        name = f"quality-{isvc.meta.namespace}/{isvc.meta.name}"
        self._spawn(self._quality(isvc, state, key), name)

    async def _quality(
        self, isvc: InferenceService, state: RolloutState, key: tuple[str, int]
    ) -> None:
        uid = isvc.meta.uid
        try:
            verdict = await self._evaluate(isvc, state, key)
        except Exception as err:  # never let a check end the controller's task group
            log.exception("quality check crashed")
            verdict = QualityVerdict(key[0], key[1], "Inconclusive", f"crashed: {err}", time.time())
        finally:
            if self._running.get(uid) == key:
                del self._running[uid]
        self._verdicts[uid] = verdict
        self._requeue(isvc.key)

    async def _evaluate(
        self, isvc: InferenceService, state: RolloutState, key: tuple[str, int]
    ) -> QualityVerdict:
        revision, step = key
        spec = isvc.spec.rollout
        assert spec is not None
        assert state.canary_template is not None

        def inconclusive(why: str) -> QualityVerdict:
            return QualityVerdict(revision, step, "Inconclusive", why, time.time())

        stable, canary = self._pods(isvc, STABLE), self._pods(isvc, CANARY)
        if not stable or not canary:
            return inconclusive("no ready stable and canary pod to compare yet")
        prompts_name = prompts = None
        ref = spec.quality.prompts
        if ref is not None:
            path = resource_path("v1", "ConfigMap", isvc.meta.namespace, ref.name)
            try:
                found = await self.client.get(path)
            except REQUEST_ERRORS as err:
                return inconclusive(f"could not read ConfigMap {ref.name}: {err}")
            data = (found or {}).get("data") or {}
            if ref.key not in data:
                return inconclusive(f"ConfigMap {ref.name} has no key {ref.key}")
            prompts_name, prompts = ref.key, str(data[ref.key])
        assert state.stable_template is not None
        checks = quality_checks(
            state.stable_template,
            state.canary_template,
            isvc.spec.served_model_name,
            spec.quality,
        )
        pair = f"{stable[0].name} against {canary[0].name}"
        said: list[str] = []
        verdict: QualityVerdict | None = None
        references = {
            k: v
            for k, v in self._references.get(isvc.meta.uid, {}).items()
            if k[0] == state.stable_revision
        }
        self._references[isvc.meta.uid] = references
        for check in checks:
            asked = (state.stable_revision, check.model, prompts)
            try:
                numbers, references[asked] = await asyncio.to_thread(
                    run_eval,
                    f"{stable[0].base_url}/v1",
                    f"{canary[0].base_url}/v1",
                    check.model,
                    prompts_name,
                    prompts,
                    references.get(asked),
                )
            except ImportError as err:
                return inconclusive(f"the eval library is missing: {err}")
            except (RuntimeError, ValueError, OSError) as err:  # EvalError, PromptFileError
                return inconclusive(f"{check.worded(pair)}: {err}")
            outcome = quality_outcome(numbers, check.gate)
            # A failure is worded alone; passes together (each model's numbers).
            worded = check.worded(outcome.message)
            said = [*said, worded] if outcome.result == "Pass" else [worded]
            verdict = QualityVerdict(
                revision,
                step,
                outcome.result,
                f"{'; '.join(said)}, {pair}",
                time.time(),
                numbers.as_status(),
            )
            if outcome.result != "Pass":
                break  # the first model that fails decides; the rest need not run
        assert verdict is not None
        return verdict

    # ---- the action annotation

    async def clear_action(self, isvc: InferenceService) -> None:
        """Remove the action annotation once acted on (or found to have nothing to act on),
        unless someone set another meanwhile. The patch tests the value that was read before
        removing it: a resourceVersion precondition would also fail on the status this
        reconcile just wrote, leaving the annotation to be refused again next time."""
        value = isvc.meta.annotations.get(ROLLOUT_ACTION_ANNOTATION)
        if value is None:
            return
        path = resource_path(API_VERSION, ISVC_KIND, isvc.meta.namespace, isvc.meta.name)
        key = "/metadata/annotations/" + ROLLOUT_ACTION_ANNOTATION.replace("~", "~0").replace(
            "/", "~1"
        )
        ops = [{"op": "test", "path": key, "value": value}, {"op": "remove", "path": key}]
        try:
            await self.client.json_patch(path, ops)
        except ApiError as err:
            # 422: the value changed or is gone (the next reconcile reads what is there now).
            if err.status not in (404, 422):
                raise
            return
        self._cleared[isvc.meta.uid] = value
