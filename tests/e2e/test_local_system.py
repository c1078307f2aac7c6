"""The whole system on the local nodes: the chart's operator (as pods) turns the examples into
real runtime pods, and the official ``openai`` client talks to them at their pod addresses and
through the chart's gateway.

All InferenceServices are applied at once, so their pods load side by side and the module pays
for one model load per pod; the destructive tests (kill -9, deletion mid-stream) come last.
"""

from __future__ import annotations

import datetime
import gzip
import json
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
import openai
import psutil
import pytest
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from ladle_dev.cluster.jaeger import Jaeger
from ladle_dev.pytest_plugin import wait_until

from .conftest import cpu_service, greedy, wait_routed

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

System = Any  # the `ladle_system` fixture's type lives in conftest.py
API_KEY = "change-me"  # examples/image-model.yaml's Secret
GROUP, GROUP_MODEL = "group", "smollm2-group"
GROUP_PROMPT = "The three primary colours are"
REFUSED = "too-long"
# An int4 copy of the model drafts (its calibration is baked into the runtime image).
SPECULATIVE = {"method": "draft_model", "numSpeculativeTokens": 4, "quantization": "int4"}


def link_tree(source: Path, target: Path) -> None:
    """Hard-link a model folder (instant, no extra disk), copying where links cannot go."""
    target.mkdir(parents=True)
    for item in source.iterdir():
        try:
            os.link(item, target / item.name)
        except OSError:
            shutil.copy2(item, target / item.name)


@pytest.fixture(scope="module")
def services(
    ladle_system: System, default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, dict[str, Any]]]:
    """Every InferenceService of the module, applied at once: cpu.yaml and smollm2.yaml as
    they are; image-model.yaml as it is (its image exists nowhere); pvc-model.yaml with its
    volume pointed at a folder holding a model at the example's path, sized for this machine
    and behind image-model.yaml's API key Secret. Four services and the chart's pods share two
    nodes of two cores (the kubelets count the machine's), so each service asks for a quarter
    of a core instead of its example's one."""
    system = ladle_system
    smollm2 = system.example("smollm2.yaml")
    # Two of the node's fake GPUs: one pod, the model split over two ranks (on its CPU).
    smollm2[0]["spec"]["resources"]["gpus"] = 2
    # A context longer than the model's: known only to the runtime, which refuses it.
    refused = cpu_service(REFUSED, "smollm2-too-long", engine={"maxModelLen": 100000})
    documents = [*system.example("cpu.yaml"), *smollm2, group_service(), refused]
    documents += system.example("image-model.yaml")
    pv, claim, llama = system.example("pvc-model.yaml")
    volume = tmp_path_factory.mktemp("models")
    volume.chmod(0o755)  # pytest makes it 0700; the runtime runs as 10001
    link_tree(default_model, volume / llama["spec"]["model"]["source"]["pvc"]["path"])
    pv["metadata"]["name"] = f"{system.namespace}-models"  # PersistentVolumes are cluster-wide
    pv["spec"]["hostPath"]["path"] = str(volume)
    claim["spec"]["volumeName"] = pv["metadata"]["name"]
    # An 8B model's settings, sized down for a 135M model on a shared 2-core machine: its
    # 8192-token warm-up step alone would hold about 9 GB, and a GPU replica falling back to
    # the CPU keeps the runtime's 4 GiB CPU KV cache (the CRD allows kvCacheMemory only with
    # gpus: 0). Still long enough to move the engine flags into the operator's ConfigMap.
    llama["spec"].pop("gpuPool")
    llama["spec"].update(replicas=1, resources={"gpus": 0, "memory": "4Gi"})
    llama["spec"]["engine"] = {
        "maxModelLen": 2048,
        "maxNumSeqs": 16,
        "maxNumBatchedTokens": 512,
        "kvCacheMemory": "512Mi",
        "enablePrefixCaching": True,
        "drainTimeoutSeconds": 60,
        # Speculative decoding rides along: its flag goes through the ConfigMap too.
        "speculative": SPECULATIVE,
    }
    llama["spec"]["apiKeySecret"] = {"name": "qwen-api-key"}
    # Profiling through the operator (docs/pipeline.md): on from the start, so no restart.
    llama["metadata"]["annotations"] = {"ladle.dev/profiling": "enabled"}
    documents += [pv, claim, llama]
    for document in documents:
        if document["kind"] == "InferenceService":
            document["spec"]["resources"]["cpu"] = "250m"
    system.apply(documents)
    yield {d["metadata"]["name"]: d for d in documents if d["kind"] == "InferenceService"}
    system.kubectl("delete", "pv", pv["metadata"]["name"], "--wait=false")


def group_service() -> dict[str, Any]:
    """A replica over two nodes (spec.parallelism.nodes: 2), one rank per pod on its node's
    CPUs (gloo between the pods). On CPUs, not the nodes' fake GPUs: a GPU pod that falls back
    to the CPU takes the runtime's default 4 GiB KV cache, and two more of those beside this
    module's other pods and the rest of the suite run the machine out of memory."""
    return cpu_service(
        GROUP, GROUP_MODEL, parallelism={"nodes": 2}, engine={"kvCacheMemory": "256Mi"}
    )


def workers(system: System) -> list[dict[str, Any]]:
    pods = system.core.list_namespaced_pod(
        system.namespace, label_selector=f"ladle.dev/worker-of={GROUP}"
    ).items
    return [system.api.sanitize_for_serialization(p) for p in pods]


def whole_group(system: System, timeout: float = 300) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Ready leader and its one running worker."""
    leader = system.ready_pod(GROUP, timeout=timeout)

    def worker() -> dict[str, Any] | None:
        mine = [
            w
            for w in workers(system)
            if w["metadata"]["labels"]["ladle.dev/leader"] == leader["metadata"]["name"]
            and not w["metadata"].get("deletionTimestamp")
            and w["status"].get("phase") == "Running"
        ]
        return mine[0] if len(mine) == 1 else None

    return leader, wait_until(worker, "the leader's worker to run", 60)


def group_answer(gateway_url: str) -> str:
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=120)
    reply = client.completions.create(
        model=GROUP_MODEL, prompt=GROUP_PROMPT, max_tokens=16, temperature=0
    )
    return str(reply.choices[0].text)


def base_url(pod: dict[str, Any]) -> str:
    return f"http://{pod['status']['podIP']}:8000/v1"


def log_lines(system: System, pod: dict[str, Any]) -> list[dict[str, Any]]:
    result = system.kubectl("logs", "-n", system.namespace, pod["metadata"]["name"])
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    return [json.loads(line) for line in lines]


def seconds(timestamp: str) -> float:
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def model_name(services: dict[str, dict[str, Any]], name: str) -> str:
    return str(services[name]["spec"]["model"]["name"])


def test_the_charts_operator_runs_as_pods_and_reconciles(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    system = ladle_system
    plan = system.cluster.cluster.network_plan()
    operators = system.core.list_namespaced_pod(
        system.system_namespace, label_selector="app.kubernetes.io/component=operator"
    ).items
    assert len(operators) == 2  # the chart's default: two replicas, one leading
    for pod in operators:
        assert pod.status.phase == "Running"
        assert pod.spec.node_name.startswith("ladle-local-")
        assert pod.status.pod_ip.startswith(f"10.{plan.block}.")
    for name in ("smollm2-cpu", "smollm2", "llama-8b"):
        system.ready_pod(name)
        obj = wait_until(
            lambda n=name: (o := system.isvc(n)) and system.condition(o, "Ready") == "True" and o,
            f"inferenceservice {name} to be Ready",
            timeout=60,
        )
        managers = {
            (f["manager"], f.get("subresource", "")) for f in obj["metadata"]["managedFields"]
        }
        assert ("ladle-operator", "status") in managers
    # One of the two pods leads, logged in with its projected ServiceAccount token.
    lease = client.CoordinationV1Api(system.api).read_namespaced_lease(
        "ladle-operator", system.system_namespace
    )
    assert lease.spec.holder_identity in {p.metadata.name for p in operators}


@pytest.mark.parametrize("name", ["smollm2-cpu", "smollm2"])
def test_examples_serve_the_openai_client_from_their_pod_ip(
    ladle_system: System, services: dict[str, dict[str, Any]], name: str
) -> None:
    pod = ladle_system.ready_pod(name)
    llm = openai.OpenAI(base_url=base_url(pod), api_key="unused", timeout=120)
    model = model_name(services, name)
    assert [m.id for m in llm.models.list()] == [model]
    reply = llm.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
    )
    assert reply.choices[0].message.content
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 0


def test_a_sampled_request_through_the_charts_gateway_is_one_trace_across_pods(
    ladle_system: System,
    services: dict[str, dict[str, Any]],
    gateway_url: str,
    collector: Jaeger,
) -> None:
    """The chart traces at a ratio of 0 here (conftest.py), so only a request whose client
    samples it is traced: its streamed chat completion is one trace from the gateway's pod to
    the runtime's, exported by each pod to Jaeger on the host, and the gateway's span is what
    the client measured."""
    # Both examples serve this model, and the gateway routes it to the older one (the other
    # is marked ModelNameConflict): wait for both, then until it answers, untraced.
    for name in ("smollm2-cpu", "smollm2"):
        ladle_system.ready_pod(name)
    model = model_name(services, "smollm2-cpu")
    wait_routed(gateway_url, model)
    trace_id = uuid.uuid4().hex
    llm = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=120, max_retries=0)
    started = time.monotonic()
    stream = llm.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=8,
        stream=True,
        extra_headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"},
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    measured = time.monotonic() - started

    def whole() -> list[dict[str, Any]] | None:
        spans = collector.trace(trace_id)
        services = {s["service"] for s in spans or ()}
        done = spans and {"engine.decode", "upstream"} <= {s["operationName"] for s in spans}
        return spans if done and services == {"ladle-gateway", "ladle-runtime"} else None

    # Each pod exports every 5 s.
    spans = wait_until(whole, "the trace from both pods in Jaeger", 60)
    shown = [(s["service"], s["operationName"], s["spanID"], s["parent"]) for s in spans]

    def one(service: str, name: str) -> dict[str, Any]:
        found = [s for s in spans if (s["service"], s["operationName"]) == (service, name)]
        assert len(found) == 1, (service, name, shown)
        return found[0]

    root = one("ladle-gateway", "POST /v1/chat/completions")
    upstream = one("ladle-gateway", "upstream")
    served = one("ladle-runtime", "POST /v1/chat/completions")
    assert root["parent"] == "00f067aa0ba902b7", shown
    assert upstream["parent"] == root["spanID"]
    assert served["parent"] == upstream["spanID"]
    assert abs(root["duration"] / 1e6 - measured) <= 0.1 * measured, (root["duration"], measured)


def test_a_pod_is_ready_only_after_health_ready_answers(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    system = ladle_system
    pod = system.ready_pod("smollm2-cpu")
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    served = next(line for line in log_lines(system, pod) if line["message"] == "ready")
    # resources.cpu 250m: one compute thread (OMP_NUM_THREADS), not one per CPU of the node.
    assert served["threads"] == 1
    # The condition has second resolution; the runtime's line has microseconds.
    assert seconds(ready["lastTransitionTime"]) >= int(seconds(served["time"]))
    events = system.core.list_namespaced_event(
        system.namespace, field_selector=f"involvedObject.name={pod['metadata']['name']}"
    ).items
    assert any(
        e.reason == "Unhealthy" and e.message.startswith("Startup probe failed") for e in events
    )


def test_gpu_pods_get_their_devices_and_the_runtime_says_it_runs_on_the_cpu(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    """The node's device plugin gives the GPU pod its two devices, named as NVIDIA's plugin
    names them; the runtime finds no CUDA behind them and says so, with the devices it was
    given."""
    system = ladle_system
    gpu_pod = system.ready_pod("smollm2")
    devices = system.cluster.container_environ(gpu_pod, "runtime")["NVIDIA_VISIBLE_DEVICES"]
    assert [d[:4] for d in devices.split(",")] == ["GPU-", "GPU-"]  # resources.gpus: 2
    notice = [
        line
        for line in log_lines(system, gpu_pod)
        if line["message"] == "no CUDA device: running on the CPU"
    ]
    assert len(notice) == 1
    assert notice[0]["nvidia_visible_devices"] == devices
    cpu_pod = system.ready_pod("smollm2-cpu")
    assert "NVIDIA_VISIBLE_DEVICES" not in system.cluster.container_environ(cpu_pod, "runtime")


def test_the_runtime_image_runs_as_its_user_on_a_read_only_root(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    """What the chart and the operator ask of a runtime pod, the kubelet and runc really do:
    uid 10001 (the image's user), no capabilities, a root file system it cannot write."""
    system = ladle_system
    pod = system.ready_pod("smollm2-cpu")
    status = Path(f"/proc/{system.container_pid(pod)}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split() == ["10001"] * 4
    assert fields["CapEff"].strip() == "0000000000000000"
    name = pod["metadata"]["name"]
    probe = "import pathlib; pathlib.Path('/opt/x').write_text('x')"
    write = system.kubectl("exec", "-n", system.namespace, name, "--", "python", "-c", probe)
    assert write.returncode != 0
    assert "Read-only file system" in write.stderr


def test_kubectl_logs_shows_the_runtimes_json_lines(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    lines = log_lines(ladle_system, ladle_system.ready_pod("smollm2-cpu"))  # each one parses
    ready = next(line for line in lines if line["message"] == "engine ready")
    assert ready["model"] == "/opt/ladle/models/SmolLM2-135M-Instruct"  # the baked model
    assert ready["device"] == "cpu"
    # The image's kernels, built for this CPU's x86-64 level: the pod compiled nothing.
    kernels = next(line for line in lines if line["message"] == "using the prebuilt CPU kernels")
    assert kernels["path"].startswith("/opt/ladle/kernels/")
    assert not any(line["message"] == "built the CPU kernels" for line in lines)
    # examples/cpu.yaml quantizes to int8 with AWQ: the image's calibration, none at start.
    awq = next(line for line in lines if line["message"] == "using the baked AWQ calibration")
    assert awq["path"].startswith("/opt/ladle/calibration/"), awq
    assert not any(line["message"].startswith("calibrating AWQ") for line in lines)
    assert all({"level", "logger", "time"} <= line.keys() for line in lines)


def test_the_pvc_examples_wiring_serves_a_model_from_the_volume_behind_its_api_key(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    """What this proves of examples/pvc-model.yaml is its wiring: the claim mounted read-only,
    the model read from the path the spec names, the API key Secret enforced, the engine flags
    through the ConfigMap. Not the 8B model: the volume holds the embedded 135M model at the
    8B path (no model hub here, and 16 GB of weights would not fit beside the suite), and the
    fixture sizes the engine down for it and drops the GPU pool."""
    system = ladle_system
    pod = system.ready_pod("llama-8b")
    model = model_name(services, "llama-8b")
    anonymous = openai.OpenAI(base_url=base_url(pod), api_key="wrong", timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        anonymous.models.list()
    assert refused.value.status_code == 401
    keyed = openai.OpenAI(base_url=base_url(pod), api_key=API_KEY, timeout=120)
    reply = keyed.completions.create(model=model, prompt="Hello", max_tokens=4)
    assert reply.choices[0].text
    engine = next(line for line in log_lines(system, pod) if line["message"] == "engine ready")
    assert engine["model"] == "/models/meta-llama/Llama-3.1-8B-Instruct"
    args = pod["spec"]["containers"][0]["args"]
    assert "--config" in args  # the engine flags went through the operator's ConfigMap

    # ladle.dev/profiling: the profiler endpoints answer behind the key, and the trace lands
    # in the pod's own emptyDir (read on its node, where `kubectl cp` would fetch it from).
    root = base_url(pod).removesuffix("/v1")
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{root}/start_profile", timeout=30).status_code == 401
    assert httpx.post(f"{root}/start_profile", headers=auth, timeout=60).status_code == 200
    assert keyed.completions.create(model=model, prompt="Hi", max_tokens=2).choices[0].text
    stopped = httpx.post(f"{root}/stop_profile", headers=auth, timeout=120)
    assert stopped.status_code == 200, stopped.text
    trace = PurePosixPath(stopped.json()["trace"])
    assert trace.parent == PurePosixPath("/var/lib/ladle/profiles")
    volume = system.cluster.empty_dir(pod, "profiles")
    events = json.loads(gzip.decompress((volume / trace.name).read_bytes()))["traceEvents"]
    assert events


def test_a_replica_of_two_gpus_splits_the_model_and_answers_as_one_rank(
    ladle_system: System, services: dict[str, dict[str, Any]], plain: Any, gateway_url: str
) -> None:
    """resources.gpus: 2 starts the runtime with --tensor-parallel-size 2: two ranks in the
    pod (gloo, on its CPU), whose greedy answer, through the chart's gateway, is one rank's,
    token for token."""
    pod = ladle_system.ready_pod("smollm2")
    (ready,) = [line for line in log_lines(ladle_system, pod) if line["message"] == "engine ready"]
    assert ready["tensor_parallel_size"] == 2
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=120)
    prompt = "The three primary colours are"
    served = client.completions.create(
        model=model_name(services, "smollm2"), prompt=prompt, max_tokens=24, temperature=0
    )
    assert served.choices[0].text == greedy(plain, prompt, 24)


def test_a_two_node_group_serves_through_the_gateway_as_one_rank(
    ladle_system: System, services: dict[str, dict[str, Any]], gateway_url: str, plain: Any
) -> None:
    """Leader and worker on different nodes, the worker pointed at the leader's address and
    outside the Service; the gateway's answer is one rank's, token for token."""
    system = ladle_system
    leader, worker = whole_group(system)
    assert worker["spec"]["nodeName"] != leader["spec"]["nodeName"]
    env = {e["name"]: e.get("value") for e in worker["spec"]["containers"][0]["env"]}
    assert env["LADLE_MASTER_ADDR"] == leader["status"]["podIP"]
    assert "ladle.dev/inferenceservice" not in worker["metadata"]["labels"]
    slices = system.kubectl(
        "get", "endpointslices", "-n", system.namespace,
        "-l", f"kubernetes.io/service-name={GROUP}", "-o",
        "jsonpath={.items[*].endpoints[*].addresses[*]}",
    )  # fmt: skip
    assert slices.stdout.split() == [leader["status"]["podIP"]]
    assert group_answer(gateway_url) == greedy(plain, GROUP_PROMPT, 16)
    obj = system.isvc(GROUP)
    assert system.condition(obj, "Ready") == "True"


def test_speculative_decoding_answers_as_the_plain_engine_and_counts_its_drafts(
    ladle_system: System, services: dict[str, dict[str, Any]], plain: Any
) -> None:
    """engine.speculative reaches the runtime (through the operator's ConfigMap): a greedy
    answer that repeats its prompt is the plain engine's, token for token, and the pod's
    vLLM spec_decode counters show the drafts it accepted."""
    pod = ladle_system.ready_pod("llama-8b")
    keyed = openai.OpenAI(base_url=base_url(pod), api_key=API_KEY, timeout=120)
    model = model_name(services, "llama-8b")
    passage = "The river flows past the mill and the church, under the old stone bridge."
    prompt = f"Repeat this passage exactly.\n\nPassage: {passage}\n\nRepeated: {passage[:20]}"
    served = keyed.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
    assert served.choices[0].text == greedy(plain, prompt, 32)
    text = httpx.get(f"{base_url(pod).removesuffix('/v1')}/metrics", timeout=30).text
    (accepted,) = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "ladle:spec_decode_num_accepted_tokens_total"
    ]
    assert accepted > 0


def test_an_image_no_registry_serves_waits_with_the_pull_error(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    """image-model.yaml names an image that exists nowhere (and no registry is reachable): the
    pod waits on its pull and the service says why, in the kubelet's words."""
    system = ladle_system

    def waiting() -> dict[str, Any] | None:
        for pod in system.pods("qwen-0-5b"):
            for status in pod["status"].get("containerStatuses") or []:
                state = status.get("state", {}).get("waiting") or {}
                if state.get("reason") in ("ErrImagePull", "ImagePullBackOff"):
                    return pod
        return None

    pod = wait_until(waiting, "the qwen pod to wait on its image", timeout=120)
    message = pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"]
    assert "registry.example.com/ladle-runtime-qwen:0.1.0" in message
    assert system.condition(pod, "Ready") == "False"
    obj = wait_until(
        lambda: (o := system.isvc("qwen-0-5b")) and system.condition(o, "Degraded") == "True" and o,
        "qwen-0-5b to read Degraded",
        timeout=60,
    )
    degraded = next(c for c in obj["status"]["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] in ("ErrImagePull", "ImagePullBackOff")


def test_settings_the_runtime_refuses_stop_at_zero_replicas_in_its_words(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    """What only the runtime can judge (a context longer than the model's, a tensor-parallel
    size its heads do not split into) ends its first run with EX_CONFIG: the operator keeps
    the Deployment at zero instead of crash-looping pods, and the service says why in the
    runtime's words until the spec changes."""
    system = ladle_system

    def refused() -> dict[str, Any] | None:
        obj = system.isvc(REFUSED)
        ready = next((c for c in obj["status"].get("conditions", ()) if c["type"] == "Ready"), {})
        return obj if ready.get("reason") == "SettingsRefused" else None

    obj = wait_until(refused, f"{REFUSED} to read SettingsRefused", timeout=240)
    ready = next(c for c in obj["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    assert "max_model_len 100000 exceeds the model's 8192" in ready["message"], ready
    assert system.condition(obj, "Stalled") == "True"
    wait_until(lambda: not system.pods(REFUSED), f"{REFUSED}'s pod to go", timeout=120)
    replicas = system.kubectl(
        "get", "deployment", f"{REFUSED}-stable", "-n", system.namespace,
        "-o", "jsonpath={.spec.replicas}",
    )  # fmt: skip
    assert replicas.stdout == "0"


def test_killing_the_worker_restarts_the_group_which_serves_again(
    ladle_system: System, services: dict[str, dict[str, Any]], gateway_url: str, plain: Any
) -> None:
    """The leader notices its rank is gone: its engine dies and its server exits, so the
    kubelet restarts it, the StatefulSet makes a new worker, they meet again, and the replica
    serves."""
    system = ladle_system
    leader, worker = whole_group(system)
    name = leader["metadata"]["name"]
    restarts = leader["status"]["containerStatuses"][0]["restartCount"]
    deleted = system.kubectl(
        "delete", "pod", "-n", system.namespace, worker["metadata"]["name"],
        "--grace-period=1", "--wait=false",
    )  # fmt: skip
    assert deleted.returncode == 0, deleted.stderr

    def unready() -> bool:
        pod = next(p for p in system.pods(GROUP) if p["metadata"]["name"] == name)
        return system.condition(pod, "Ready") != "True"

    wait_until(unready, "the leader to turn unready", 60)
    again, new_worker = whole_group(system, timeout=400)
    assert again["metadata"]["name"] == name
    assert again["status"]["containerStatuses"][0]["restartCount"] > restarts
    assert new_worker["metadata"]["uid"] != worker["metadata"]["uid"]
    assert group_answer(gateway_url) == greedy(plain, GROUP_PROMPT, 16)


def test_kill_9_restarts_the_runtime_unready_in_between_and_it_serves_again(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    system = ladle_system
    pod = system.ready_pod("smollm2-cpu")
    name = pod["metadata"]["name"]
    pid = system.container_pid(pod)
    # The API server stamps conditions in whole seconds, from this machine's clock.
    killed = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    os.kill(pid, signal.SIGKILL)

    def status() -> dict[str, Any]:
        current = next(p for p in system.pods("smollm2-cpu") if p["metadata"]["name"] == name)
        return current

    restarted = wait_until(
        lambda: (s := status())["status"]["containerStatuses"][0]["restartCount"] == 1 and s,
        "the runtime container to restart",
        timeout=30,
    )
    # Unready in between: still, or Ready again only since a transition after the kill (a
    # restart on a quiet machine can be Ready before this poll sees it).
    ready = next(c for c in restarted["status"]["conditions"] if c["type"] == "Ready")
    since = datetime.datetime.fromisoformat(ready["lastTransitionTime"])
    assert ready["status"] == "False" or since >= killed, ready
    runtime = restarted["status"]["containerStatuses"][0]
    assert runtime["lastState"]["terminated"]["exitCode"] == 137
    assert runtime["lastState"]["terminated"]["reason"] == "Error"
    again = system.ready_pod("smollm2-cpu", timeout=180)
    assert again["metadata"]["name"] == name
    assert again["status"]["containerStatuses"][0]["restartCount"] == 1
    assert system.container_pid(again) != pid
    assert not psutil.pid_exists(pid)
    llm = openai.OpenAI(base_url=base_url(again), api_key="unused", timeout=120)
    reply = llm.completions.create(
        model=model_name(services, "smollm2-cpu"), prompt="Hello", max_tokens=4
    )
    assert reply.choices[0].text


def test_deleting_the_service_mid_stream_drains_it_then_the_pod_goes(
    ladle_system: System, services: dict[str, dict[str, Any]]
) -> None:
    system = ladle_system
    pod = system.ready_pod("smollm2")
    name = pod["metadata"]["name"]
    pid = system.container_pid(pod)
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    model = model_name(services, "smollm2")
    llm = openai.OpenAI(base_url=base_url(pod), api_key="unused", timeout=120)
    # Size the stream to last about 10 s on this machine: past the 5 s preStop pause, so
    # SIGTERM finds it running, and well inside the 30 s drain.
    started = time.monotonic()
    llm.completions.create(model=model, prompt="Hi", max_tokens=16, extra_body={"ignore_eos": True})
    rate = 16 / (time.monotonic() - started)
    max_tokens = max(24, min(300, int(rate * 10)))
    stream = llm.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    outcome: dict[str, Any] = {}

    def drink() -> None:
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome["finish_reason"] = chunk.choices[0].finish_reason
            if chunk.usage is not None:
                outcome["tokens"] = chunk.usage.completion_tokens
        outcome["ended"] = time.monotonic()

    reader = threading.Thread(target=drink)
    reader.start()
    deleted = time.monotonic()
    result = system.kubectl("delete", "lisvc", "smollm2", "-n", system.namespace, "--wait=false")
    assert result.returncode == 0, result.stderr
    reader.join(timeout=grace + 30)
    wait_until(
        lambda: name not in {p["metadata"]["name"] for p in system.pods("smollm2")},
        "the pod object to go",
        timeout=grace + 30,
    )
    gone = time.monotonic()
    assert outcome.get("finish_reason") == "length", outcome
    assert outcome.get("tokens") == max_tokens
    assert outcome["ended"] - deleted > 5  # it outlived the preStop pause: drained after SIGTERM
    assert gone - deleted < grace
    assert not psutil.pid_exists(pid)
