#!/usr/bin/env python3
"""Flow control on real pods: two ``ladle serve`` processes of the embedded model (each pinned
to its own core, one thread, ``--max-num-seqs`` slots, prefix caching off) behind the gateway,
loaded by ``ladle bench serve``. Three parts, each comparing equal work in alternating runs:

``binding``: a gateway binding late (``routing.maxConcurrency`` = the slots) against one binding
early (0), in turn, at three times the pods' slots with varied lengths. TTFT and throughput for
each, and the pods' own queues (``ladle:num_requests_waiting``, read every 0.2 s).

``fairness``: a light tenant (one API key, a few requests at a time) alone, then beside a heavy
one (another key, ten times as many in flight), then beside the heavy one under the heavy one's
key (first come, first served: what a gateway without fair shares gives it). On pods ordering
by priority the light tenant, under its share, displaces the heavy one's requests (``fcfs``:
order only). Target: beside the heavy tenant, the light one's TTFT p99 within 1.5x of its own
alone.

``priority``: a ``critical`` key's requests unloaded, then while a ``sheddable`` key overloads
the service past the gateway's queue (``--max-held-requests``), on pods that order by priority
(``--scheduling-policy priority``: the gateway binds a critical request beyond a full pod's
slots and the engine preempts a sheddable one for it; ``--scheduling-policy fcfs`` for bands
that order the gateway's queue only). Targets: the critical TTFT p99 within 1.5x of unloaded,
and only the sheddable key gets 429s.

Run on a quiet machine:  .venv/bin/python bench/flow_control.py binding --repeats 3
                          .venv/bin/python bench/flow_control.py fairness
                          .venv/bin/python bench/flow_control.py --smoke   (checks it works)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from harness import bench_serve_run, gateway, ladle_serve

from ladle.runtime_metrics import WAITING, samples

TARGET_RATIO = 1.5
KEYS = {
    "light": ("sk-light-000001", "standard"),
    "heavy": ("sk-heavy-000001", "standard"),
    "urgent": ("sk-urgent-00001", "critical"),
    "batch": ("sk-batch-000001", "sheddable"),
}


class QueueSampler:
    """Samples the pods' own queues (``ladle:num_requests_waiting``, summed) in a thread."""

    def __init__(self, ports: list[int], every: float = 0.2) -> None:
        self.ports = ports
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.wait(self.every):
                total = 0.0
                for port in self.ports:
                    page = client.get(f"http://127.0.0.1:{port}/metrics").text
                    total += sum(v for _, v in samples(page, (WAITING,))[WAITING])
                self.samples.append(total)


@contextlib.contextmanager
def pods(workdir: Path, slots: int, flags: tuple[str, ...] = ()) -> Iterator[list[int]]:
    cores = sorted(os.sched_getaffinity(0))
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(ladle_serve(workdir, slots, cores[i % len(cores)], flags))
            for i in range(2)
        ]


def cell(values: list[float], fmt: str) -> str:
    return (
        f"{format(statistics.median(values), fmt)} "
        f"({format(min(values), fmt)}-{format(max(values), fmt)})"
    )


def table(arms: list[str], rows: list[tuple[str, Callable[[str], list[float]], str]]) -> None:
    print(f"  {'':36}" + "".join(f" {a:>24}" for a in arms))
    for label, values, fmt in rows:
        print(f"  {label:36}" + "".join(f" {cell(values(a), fmt):>24}" for a in arms))


def bench_binding(args: argparse.Namespace, workdir: Path) -> bool:
    slots = args.slots
    concurrency = 3 * 2 * slots
    runs: dict[str, list[dict[str, Any]]] = {"late": [], "early": []}
    queues: dict[str, list[list[float]]] = {"late": [], "early": []}
    with contextlib.ExitStack() as stack:
        ports = stack.enter_context(pods(workdir, slots))
        gateways = {
            arm: stack.enter_context(
                gateway(ports, workdir, None, routing={"maxConcurrency": limit})
            )[0]
            for arm, limit in (("late", slots), ("early", 0))
        }
        for i in range(args.repeats):
            for arm in ("late", "early") if i % 2 == 0 else ("early", "late"):
                out = workdir / f"binding-{arm}-{i}.json"
                with QueueSampler(ports) as sampler:
                    runs[arm].append(
                        bench_serve_run(
                            f"http://127.0.0.1:{gateways[arm]}", args.num_prompts,
                            args.input_len, args.output_len, concurrency, out, range_ratio=0.8,
                        )
                    )  # fmt: skip
                queues[arm].append(sampler.samples)
    print(
        f"\nlate binding against early: 2 ladle serve pods x {slots} slots, {args.num_prompts} "
        f"prompts, {args.input_len} in / {args.output_len} out (+-80%), concurrency "
        f"{concurrency} (3x the slots), x {args.repeats} (alternating)"
    )
    table(
        ["late", "early"],
        [
            ("TTFT p50 (ms)", lambda a: [r["p50_ttft_ms"] for r in runs[a]], ".1f"),
            ("TTFT p99 (ms)", lambda a: [r["p99_ttft_ms"] for r in runs[a]], ".1f"),
            ("output tokens/s", lambda a: [r["output_throughput"] for r in runs[a]], ".1f"),
            ("pods' own queue, mean", lambda a: [statistics.fmean(q) for q in queues[a]], ".2f"),
            ("pods' own queue, max", lambda a: [max(q) for q in queues[a]], ".0f"),
        ],
    )
    ratios = [
        late["p99_ttft_ms"] / early["p99_ttft_ms"]
        for late, early in zip(runs["late"], runs["early"], strict=True)
    ]
    print(
        f"  TTFT p99 late / early, run by run: median {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f} - {max(ratios):.2f})"
    )
    return True


def keys_file(workdir: Path) -> Path:
    path = workdir / "keys.yaml"
    path.write_text(
        "keys:\n"
        + "".join(
            f"  - {{name: {name}, key: {key}, priority: {band}}}\n"
            for name, (key, band) in KEYS.items()
        )
    )
    return path


@dataclass(frozen=True)
class Load:
    """A heavy client: its key, how many requests, how many at a time, how fast."""

    key: str
    prompts: int
    concurrency: int
    rate: str = "inf"
    refused: bool = False  # it overloads the service: refusals are counted, not fatal


def light_and_heavy(
    args: argparse.Namespace,
    url: str,
    workdir: Path,
    light_key: str,
    heavy: Load | None,
    tag: str,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The light client's run, with the heavy client loading the service from before it
    starts to after it ends."""
    light_prompts = args.light_prompts
    with ThreadPoolExecutor(2) as pool:
        loaded: Future[dict[str, Any]] | None = None
        if heavy is not None:
            loaded = pool.submit(
                bench_serve_run, url, heavy.prompts, args.input_len, args.output_len,
                heavy.concurrency, workdir / f"heavy-{tag}.json", 0.0,
                ("--api-key", heavy.key, "--request-rate", heavy.rate), heavy.refused,
            )  # fmt: skip
            time.sleep(args.lead)  # the heavy client fills the pods and the queue first
        light = bench_serve_run(
            url, light_prompts, args.input_len, args.output_len, 2,
            workdir / f"light-{tag}.json", 0.0, ("--api-key", light_key, "--request-rate", "1"),
        )  # fmt: skip
        return light, None if loaded is None else loaded.result()


def bench_fairness(args: argparse.Namespace, workdir: Path) -> bool:
    slots = args.slots
    heavy = Load(KEYS["heavy"][0], args.heavy_prompts, 10 * 2)
    arms = {
        "alone": (KEYS["light"][0], None),
        "fair shares": (KEYS["light"][0], heavy),
        "one key (FCFS)": (KEYS["heavy"][0], heavy),
    }
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    policy = args.scheduling_policy
    with contextlib.ExitStack() as stack:
        ports = stack.enter_context(pods(workdir, slots, ("--scheduling-policy", policy)))
        port, _ = stack.enter_context(
            gateway(
                ports, workdir, None, routing={"maxConcurrency": slots},
                flags=("--api-keys-file", str(keys_file(workdir))),
                engine={"schedulingPolicy": policy},
            )
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        names = list(arms)
        for i in range(args.repeats):
            for arm in names[i % 3 :] + names[: i % 3]:
                key, load = arms[arm]
                light, _ = light_and_heavy(args, url, workdir, key, load, f"{arm}-{i}")
                runs[arm].append(light)
    print(
        f"\nfair shares: 2 pods x {slots} slots scheduling by {policy}; the light tenant sends "
        f"{args.light_prompts} "
        f"requests (1/s, 2 at a time), the heavy one {args.heavy_prompts} (20 at a time), "
        f"{args.input_len} in / {args.output_len} out, x {args.repeats} (alternating)"
    )
    table(
        names,
        [
            ("light TTFT p50 (ms)", lambda a: [r["p50_ttft_ms"] for r in runs[a]], ".0f"),
            ("light TTFT p99 (ms)", lambda a: [r["p99_ttft_ms"] for r in runs[a]], ".0f"),
        ],
    )
    alone = statistics.median(r["p99_ttft_ms"] for r in runs["alone"])
    ok = True
    for arm in names[1:]:
        ratio = statistics.median(r["p99_ttft_ms"] for r in runs[arm]) / alone
        verdict = "met" if ratio <= TARGET_RATIO else "MISSED"
        print(f"  light TTFT p99, {arm} / alone: {ratio:.2f}")
        if arm == "fair shares":
            print(f"  target <= {TARGET_RATIO}: {verdict}")
            ok = ratio <= TARGET_RATIO
    return ok


def bench_priority(args: argparse.Namespace, workdir: Path) -> bool:
    slots = args.slots
    max_held = 2 * 2 * slots
    # Three times what the pods serve (about 1.5 requests/s here), long enough to outlast the
    # critical client's run.
    flood = Load(KEYS["batch"][0], args.heavy_prompts, args.heavy_prompts, "5", True)
    runs: dict[str, list[dict[str, Any]]] = {"unloaded": [], "overloaded": []}
    floods: list[dict[str, Any]] = []
    policy = args.scheduling_policy
    with contextlib.ExitStack() as stack:
        ports = stack.enter_context(pods(workdir, slots, ("--scheduling-policy", policy)))
        port, _ = stack.enter_context(
            gateway(
                ports, workdir, None, routing={"maxConcurrency": slots},
                flags=("--api-keys-file", str(keys_file(workdir)),
                       "--max-held-requests", str(max_held)),
                engine={"schedulingPolicy": policy},
            )
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        for i in range(args.repeats):
            for arm in ("unloaded", "overloaded") if i % 2 == 0 else ("overloaded", "unloaded"):
                load = flood if arm == "overloaded" else None
                urgent, flooded = light_and_heavy(
                    args, url, workdir, KEYS["urgent"][0], load, f"{arm}-{i}"
                )
                runs[arm].append(urgent)
                if flooded is not None:
                    floods.append(flooded)
    print(
        f"\npriority: 2 pods x {slots} slots scheduling by {policy}, a queue of {max_held}; "
        f"the critical key sends "
        f"{args.light_prompts} requests (1/s, 2 at a time) while the sheddable key sends "
        f"{flood.prompts} at 5/s, x {args.repeats} (alternating)"
    )
    table(
        list(runs),
        [
            ("critical TTFT p50 (ms)", lambda a: [r["p50_ttft_ms"] for r in runs[a]], ".0f"),
            ("critical TTFT p99 (ms)", lambda a: [r["p99_ttft_ms"] for r in runs[a]], ".0f"),
            ("critical requests failed", lambda a: [r["failed"] for r in runs[a]], ".0f"),
        ],
    )
    shed = [f["failed"] for f in floods]
    print(f"  sheddable requests refused (429) per run: {cell(shed, '.0f')} of {flood.prompts}")
    ratio = statistics.median(r["p99_ttft_ms"] for r in runs["overloaded"]) / statistics.median(
        r["p99_ttft_ms"] for r in runs["unloaded"]
    )
    critical_failed = sum(int(r["failed"]) for rs in runs.values() for r in rs)
    ok = bool(ratio <= TARGET_RATIO and critical_failed == 0 and min(shed) > 0)
    print(
        f"  critical TTFT p99 overloaded / unloaded: {ratio:.2f} (target <= {TARGET_RATIO}); "
        f"critical failures {critical_failed}; the flood was shed: {min(shed) > 0}"
    )
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "part", nargs="?", choices=("all", "binding", "fairness", "priority"), default="all"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--slots", type=int, default=4, help="each pod's max-num-seqs")
    parser.add_argument("--num-prompts", type=int, default=96, help="binding: requests a run")
    parser.add_argument("--light-prompts", type=int, default=16)
    parser.add_argument("--heavy-prompts", type=int, default=180)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument(
        "--lead", type=float, default=5.0, help="seconds the heavy client runs alone first"
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=("priority", "fcfs"),
        default="priority",
        help="priority: the pods' engines displace a lower band for a higher one; fcfs: bands "
        "order the gateway's queue only",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: proves the script works")
    args = parser.parse_args()
    if args.smoke:
        args.repeats, args.num_prompts, args.light_prompts, args.heavy_prompts = 1, 8, 3, 24
        args.input_len, args.output_len, args.lead = 16, 4, 1.0
    ok = True
    parts = {"binding": bench_binding, "fairness": bench_fairness, "priority": bench_priority}
    with tempfile.TemporaryDirectory(prefix="ladle-bench-flow-") as tmp:
        for name, part in parts.items():
            if args.part in ("all", name):
                ok &= part(args, Path(tmp))
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
