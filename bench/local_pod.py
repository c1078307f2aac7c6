"""Time from `kubectl apply` to the first token on a local node, and one runtime pod's memory,
against the baseline of the same `ladle serve` started directly on the host, in the same run.

    python bench/local_pod.py --repeats 5        # as root, on a quiet machine (no helper)

It starts a dedicated cluster with one local node (`ladle up`'s steps: the images, the chart's
operator and gateway as pods, the GPUPool), then alternates: apply examples/cpu.yaml and time
each phase until a token streams from the pod's address, delete it; start `ladle serve` with
the pod's flags on the host and time it to its first token, stop it. Both start cold (a fresh
process, a fresh cache folder, as a pod's emptyDir is) with the same files: the host process
reads the runtime image's own baked model, CPU kernels and AWQ calibrations (the image mounted
read-only by buildah), so the page cache favours neither. The pod pays for the kubelet, the
container runtime, the sandbox, CNI and the probes; the host process for nothing of that.
Prints the median and the range of each phase, and the runtime process's RSS, PSS and USS.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from kubernetes import client, config

from ladle_dev.cluster import build, images
from ladle_dev.cluster.control_plane import Options
from ladle_dev.cluster.up import EXAMPLES, NAMESPACE, System

SERVICE = "cpu.yaml"
MIB = 2**20


def first_token(base_url: str, model: str) -> None:
    """Stream one completion and return as soon as its first token arrives."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 8, "stream": True}
    with (
        httpx.Client(timeout=120) as http,
        http.stream("POST", f"{base_url}/completions", json=body) as rsp,
    ):
        rsp.raise_for_status()
        for line in rsp.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return
    raise RuntimeError("the stream ended without a token")


def memory(pid: int) -> dict[str, float]:
    info = psutil.Process(pid).memory_full_info()
    return {"rss": info.rss / MIB, "pss": info.pss / MIB, "uss": info.uss / MIB}


def poll(check: Callable[[], Any], what: str, timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        if result := check():
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def pod_run(system: System, core: client.CoreV1Api, service: dict[str, Any]) -> dict[str, Any]:
    name = service["metadata"]["name"]
    selector = f"ladle.dev/inferenceservice={name}"
    started = time.monotonic()
    system.kubectl("apply", "-n", NAMESPACE, "-f", str(EXAMPLES / SERVICE))
    marks: dict[str, float] = {}

    def ready() -> Any:
        for pod in core.list_namespaced_pod(NAMESPACE, label_selector=selector).items:
            if pod.spec.node_name and "scheduled" not in marks:
                marks["scheduled"] = time.monotonic() - started
            statuses = pod.status.container_statuses or []
            if statuses and statuses[0].state.running and "running" not in marks:
                marks["running"] = time.monotonic() - started
            conditions = {c.type: c.status for c in pod.status.conditions or []}
            if conditions.get("Ready") == "True":
                return pod
        return None

    pod = poll(ready, "a Ready pod")
    marks["ready"] = time.monotonic() - started
    first_token(f"http://{pod.status.pod_ip}:8000/v1", service["spec"]["model"]["name"])
    marks["first token"] = time.monotonic() - started
    node = next(n for n in system.cluster.local_nodes() if n.spec.name == pod.spec.node_name)
    container = pod.status.container_statuses[0].container_id.split("://", 1)[1]
    result = {"times": marks, "memory": memory(node.container_pid(build.bin_dir(), container))}
    result["args"] = pod.spec.containers[0].args
    result["env"] = {e.name: e.value for e in pod.spec.containers[0].env or () if e.value}
    system.kubectl("delete", "lisvc", name, "-n", NAMESPACE, "--wait=false")
    poll(
        lambda: not core.list_namespaced_pod(NAMESPACE, label_selector=selector).items,
        "the pod to go",
    )
    return result


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def image_root() -> Iterator[Path]:
    """The runtime image's root file system, mounted by buildah for the host process to read
    the same baked files as the pod."""
    container = subprocess.run(
        images.buildah_argv("from", "--quiet", images.RUNTIME.reference),
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    try:
        mounted = subprocess.run(
            images.buildah_argv("mount", container), capture_output=True, text=True, check=True
        ).stdout.strip()
        yield Path(mounted)
    finally:
        subprocess.run(images.buildah_argv("rm", container), capture_output=True, check=False)


def bare_run(args: list[str], pod_env: dict[str, str], model: str, root: Path) -> dict[str, Any]:
    """The baseline: the pod's command line and environment as a plain process on the host."""
    port = free_port()
    flags = list(args)
    flags[flags.index("--host") + 1] = "127.0.0.1"
    flags[flags.index("--port") + 1] = str(port)
    with tempfile.TemporaryDirectory() as cache:
        env = {
            **os.environ,
            **pod_env,
            "XDG_CACHE_HOME": cache,
            "LADLE_DEFAULT_MODEL_DIR": str(root / "opt/ladle/models/SmolLM2-135M-Instruct"),
            "LADLE_KERNELS_DIR": str(root / "opt/ladle/kernels"),
            "LADLE_CALIBRATION_DIR": str(root / "opt/ladle/calibration"),
        }
        started = time.monotonic()
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "ladle"), "serve", *flags],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:

            def ready() -> bool:
                try:
                    url = f"http://127.0.0.1:{port}/health/ready"
                    with urllib.request.urlopen(url, timeout=1) as rsp:
                        return bool(rsp.status == 200)
                except OSError:
                    return False

            poll(ready, "the bare server")
            marks = {"ready": time.monotonic() - started}
            first_token(f"http://127.0.0.1:{port}/v1", model)
            marks["first token"] = time.monotonic() - started
            return {"times": marks, "memory": memory(proc.pid)}
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def summary(values: list[float], unit: str) -> str:
    return f"{statistics.median(values):7.1f} {unit} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args()
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="ladle-bench-"))
    system = System(state_dir)
    service = yaml.safe_load((EXAMPLES / SERVICE).read_text())
    model = service["spec"]["model"]["name"]
    try:
        endpoint = system.up(Options(nodes=0, local_nodes=1), timeout=600)
        system.kubectl("delete", "lisvc", "--all", "-n", NAMESPACE, "--wait=true")
        print(f"system up; default service served at {endpoint.base_url}; now measuring")
        core = client.CoreV1Api(config.new_client_from_config(str(system.cluster.kubeconfig)))
        pods: list[dict[str, Any]] = []
        bares: list[dict[str, Any]] = []
        with image_root() as root:
            for index in range(args.repeats):
                pods.append(pod_run(system, core, service))
                bares.append(bare_run(pods[-1]["args"], pods[-1]["env"], model, root))
                print(f"  round {index + 1}: pod {pods[-1]['times']}, bare {bares[-1]['times']}")
    finally:
        system.down()
    print(f"\n{args.repeats} rounds of examples/{SERVICE}, {os.cpu_count()} CPUs")
    print("phase (seconds from apply / from process start)   pod on a local node    bare process")
    for phase in ("scheduled", "running", "ready", "first token"):
        pod_times = [p["times"][phase] for p in pods if phase in p["times"]]
        bare_times = [b["times"][phase] for b in bares if phase in b["times"]]
        left = summary(pod_times, "s") if pod_times else "-"
        right = summary(bare_times, "s") if bare_times else "-"
        print(f"  {phase:<48} {left:<22} {right}")
    for kind in ("rss", "pss", "uss"):
        left = summary([p["memory"][kind] for p in pods], "MiB")
        right = summary([b["memory"][kind] for b in bares], "MiB")
        print(f"  runtime process {kind.upper():<32} {left:<22} {right}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
