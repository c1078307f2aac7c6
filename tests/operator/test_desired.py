"""Spec → children: names, wiring, security and flags, without a cluster."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
from typing import Any

import pytest
import yaml

from ladle import settings
from ladle.api import parse_isvc, parse_pool
from ladle.cli import build_parser
from ladle.operator.config import OperatorConfig
from ladle.operator.desired import (
    CONFIG_HASH_ANNOTATION,
    TEMPLATE_HASH_ANNOTATION,
    blueprint,
    children_of,
    desired_children,
    group_children,
    object_digest,
    refusal,
    template_hash,
)
from ladle.operator.runtime_flags import (
    Profiling,
    engine_config,
    operator_settings,
    profiling,
    render_flags,
)
from ladle.operator.service_objects import desired_service
from ladle.operator.store import PodInfo
from ladle.runtime.config import EngineArgs
from ladle.runtime.spec_decode.config import SpeculativeConfig

CONFIG = OperatorConfig(runtime_image="registry.test/ladle-runtime:1")
Builder = Any


def container(children: Any) -> dict[str, Any]:
    containers: list[dict[str, Any]] = children.deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def test_children_are_named_labelled_and_owned_deterministically(make_isvc: Builder) -> None:
    isvc = parse_isvc(make_isvc("chat", "team-a"))
    children = desired_children(isvc, None, 2, CONFIG)
    objects = [*children.all(), desired_service(isvc)]
    names = [(c["kind"], c["metadata"]["name"]) for c in objects]
    assert names == [
        ("Deployment", "chat-stable"),
        ("PodDisruptionBudget", "chat-stable"),
        ("Service", "chat"),
    ]
    assert children.config_map is None
    for child in objects:
        meta = child["metadata"]
        assert meta["namespace"] == "team-a"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "ladle-operator"
        assert meta["labels"]["ladle.dev/inferenceservice"] == "chat"
        assert meta["ownerReferences"] == [
            {
                "apiVersion": "ladle.dev/v1alpha1",
                "kind": "InferenceService",
                "name": "chat",
                "uid": "uid-team-a-chat",
                "controller": True,
            }
        ]
    assert children.config_map is None
    again = desired_children(parse_isvc(make_isvc("chat", "team-a")), None, 2, CONFIG)
    assert [object_digest(c) for c in again.all()] == [object_digest(c) for c in children.all()]


def test_deployment_runs_ladle_serve_with_probes_drain_and_hardening(make_isvc: Builder) -> None:
    isvc = parse_isvc(make_isvc(spec={"engine": {"drainTimeoutSeconds": 45}}))
    children = desired_children(isvc, None, 3, CONFIG)
    spec = children.deployment["spec"]
    pod = spec["template"]["spec"]
    ctr = container(children)
    assert spec["replicas"] == 3
    assert spec["selector"]["matchLabels"] == {
        "ladle.dev/inferenceservice": "chat",
        "ladle.dev/variant": "stable",
    }
    assert ctr["image"] == "registry.test/ladle-runtime:1"
    assert ctr["command"] == ["ladle", "serve"]
    assert ctr["args"][:4] == ["--host", "0.0.0.0", "--port", "8000"]
    assert ctr["livenessProbe"]["httpGet"]["path"] == "/health/live"
    assert ctr["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # model load budget
    # SIGTERM arrives after the preStop pause; the drain must end before SIGKILL.
    pause = ctr["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] > pause + 45
    assert ctr["args"][-2:] == ["--drain-timeout", "45"]
    assert ctr["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False
    annotations = spec["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "8000"
    assert ctr["resources"] == {
        "requests": {"nvidia.com/gpu": "1"},
        "limits": {"nvidia.com/gpu": "1"},
    }


def test_pool_supplies_gpu_resource_node_selector_and_tolerations(
    make_isvc: Builder, make_pool: Builder
) -> None:
    pool = parse_pool(
        make_pool(
            spec={
                "nodeSelector": {"pool": "a"},
                "product": "NVIDIA-H200",
                "resourceName": "example.com/gpu",
                "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
            }
        )
    )
    isvc = parse_isvc(
        make_isvc(spec={"gpuPool": "h200", "resources": {"gpus": 2, "cpu": 4, "memory": "16Gi"}})
    )
    children = desired_children(isvc, pool.spec, 1, CONFIG)
    pod = children.deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "a", "nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert container(children)["resources"] == {
        "requests": {"cpu": "4", "memory": "16Gi", "example.com/gpu": "2"},
        "limits": {"memory": "16Gi", "example.com/gpu": "2"},
    }


@pytest.mark.parametrize(
    ("spec", "chart", "flags"),
    [
        ({}, None, []),
        ({}, "http://otel:4318", ["--otlp-traces-endpoint", "http://otel:4318",
                                  "--trace-sample-ratio", "0.25"]),
        ({"samplingRatio": 1.0}, "http://otel:4318",
         ["--otlp-traces-endpoint", "http://otel:4318", "--trace-sample-ratio", "1.0"]),
        ({"endpoint": "http://mine:4318"}, None,
         ["--otlp-traces-endpoint", "http://mine:4318", "--trace-sample-ratio", "0.25"]),
    ],
    ids=["off", "the chart's", "the chart's endpoint at the spec's ratio", "the spec's own"],
)  # fmt: skip
def test_runtime_pods_trace_where_the_spec_or_else_the_chart_says(
    make_isvc: Builder, spec: dict[str, Any], chart: str | None, flags: list[str]
) -> None:
    config = OperatorConfig(runtime_otlp_traces_endpoint=chart, runtime_trace_sample_ratio=0.25)
    isvc = parse_isvc(make_isvc(spec={"model": {"name": "m"}, "tracing": spec}))
    assert render_flags(operator_settings(isvc, config)) == flags


@pytest.mark.parametrize(
    ("cpu", "threads"), [("250m", "1"), (1, "1"), ("2500m", "2"), (4, "4"), (None, None)]
)
def test_compute_threads_follow_the_cpus_the_pod_is_promised(
    make_isvc: Builder, cpu: str | int | None, threads: str | None
) -> None:
    resources: dict[str, Any] = {"gpus": 0} if cpu is None else {"gpus": 0, "cpu": cpu}
    isvc = parse_isvc(make_isvc(spec={"resources": resources}))
    env = {e["name"]: e["value"] for e in container(desired_children(isvc, None, 1, CONFIG))["env"]}
    assert env.get("OMP_NUM_THREADS") == threads


def test_engine_settings_become_ladle_serve_flags(make_isvc: Builder) -> None:
    isvc = parse_isvc(
        make_isvc(
            spec={
                "model": {"name": "llama", "source": {"pvc": {"claimName": "m", "path": "l/8b"}}},
                "engine": {
                    "dtype": "bfloat16",
                    "maxModelLen": 8192,
                    "maxNumSeqs": 64,
                    "enablePrefixCaching": False,
                    "gpuMemoryUtilization": 0.85,
                    "seed": 7,
                },
            }
        )
    )
    assert render_flags(engine_config(isvc)) == [
        "--served-model-name", "llama",
        "--model", "/models/l/8b",
        "--dtype", "bfloat16",
        "--max-model-len", "8192",
        "--max-num-seqs", "64",
        "--scheduling-policy", "priority",  # the gateway's bands reach the engine
        "--no-enable-prefix-caching",
        "--gpu-memory-utilization", "0.85",
        "--seed", "7",
        "--drain-timeout", "30",
    ]  # fmt: skip


def test_a_replica_of_several_gpus_is_one_pod_split_over_them(make_isvc: Builder) -> None:
    """Tensor parallelism in one pod: every GPU requested, vLLM's flag, which the runtime's
    own parser reads back."""
    isvc = parse_isvc(make_isvc(spec={"model": {"name": "m"}, "resources": {"gpus": 4}}))
    children = desired_children(isvc, None, 2, CONFIG)
    ctr = container(children)
    assert ctr["resources"] == {
        "requests": {"nvidia.com/gpu": "4"},
        "limits": {"nvidia.com/gpu": "4"},
    }
    flags = render_flags(engine_config(isvc))
    assert flags[flags.index("--tensor-parallel-size") + 1] == "4"
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert parser.parse_known_args(flags)[0].tensor_parallel_size == 4
    one = parse_isvc(make_isvc(spec={"model": {"name": "m"}, "resources": {"gpus": 1}}))
    assert "--tensor-parallel-size" not in render_flags(engine_config(one))


def _leader(pod_template: dict[str, Any], name: str, uid: str, node: str, ip: str) -> PodInfo:
    """A live pod of the Deployment, as the API server would hold it once scheduled."""
    pod = {
        "metadata": {
            "name": name,
            "namespace": "default",
            "uid": uid,
            "labels": pod_template["metadata"]["labels"],
            "annotations": pod_template["metadata"]["annotations"],
        },
        "spec": {**pod_template["spec"], "nodeName": node},
        "status": {"phase": "Running", "podIP": ip},
    }
    return PodInfo.from_pod(pod)


def test_a_replica_over_two_nodes_is_a_leader_and_a_worker_set(make_isvc: Builder) -> None:
    """spec.parallelism.nodes: the Deployment's pods lead (every rank's flags, node rank 0,
    their own address as the master's); each leader placed on a node gets a StatefulSet of
    workers from the same template, pointed at its address, kept off its node, owned by it,
    and selected by no Service; the runtime's parser reads both pods' flags back."""
    isvc = parse_isvc(
        make_isvc(
            "big",
            spec={"model": {"name": "m"}, "resources": {"gpus": 2}, "parallelism": {"nodes": 2}},
        )
    )
    assert isvc.spec.parallelism.tensor == 4
    assert isvc.spec.gpus_per_replica == 4
    bp = blueprint(isvc, None, CONFIG)
    leader = bp.template
    ctr = leader["spec"]["containers"][0]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["LADLE_NODE_RANK"]["value"] == "0"
    assert env["LADLE_MASTER_ADDR"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["LADLE_PARALLEL_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "big-group"
    assert group_children(bp, []) == [group_children(bp, [])[0]]  # no leader yet: no workers
    unplaced = _leader(leader, "big-stable-abc", "uid-0", "", "")
    old = _leader(leader, "big-stable-old", "uid-1", "node-b", "10.0.0.9")
    old = dataclasses.replace(old, group_template="an-older-template")
    placed = _leader(leader, "big-stable-xyz", "uid-2", "node-a", "10.0.0.7")
    service, workers = group_children(bp, [unplaced, old, placed])
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"ladle.dev/group": "big-stable"}
    assert workers["kind"] == "StatefulSet"
    assert workers["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "big-stable-xyz", "uid": "uid-2",
         "controller": True}
    ]  # fmt: skip
    spec = workers["spec"]
    assert (spec["replicas"], spec["ordinals"], spec["serviceName"]) == (
        1, {"start": 1}, "big-stable-group"
    )  # fmt: skip
    labels = spec["template"]["metadata"]["labels"]
    assert "ladle.dev/inferenceservice" not in labels  # no Service or gateway picks a worker
    assert labels["ladle.dev/worker-of"] == "big"
    assert spec["selector"]["matchLabels"] == {"ladle.dev/leader": "big-stable-xyz"}
    worker = spec["template"]["spec"]["containers"][0]
    assert "readinessProbe" not in worker
    assert "ports" not in worker
    wenv = {e["name"]: e for e in worker["env"]}
    assert wenv["LADLE_MASTER_ADDR"] == {"name": "LADLE_MASTER_ADDR", "value": "10.0.0.7"}
    assert wenv["LADLE_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['apps.kubernetes.io/pod-index']"
    )
    assert worker["resources"] == ctr["resources"]
    assert worker["args"] == ctr["args"]
    affinity = spec["template"]["spec"]["affinity"]
    term = affinity["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["node-a"]
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    expanded = [
        a.replace("$(LADLE_NODE_RANK)", "1").replace("$(LADLE_MASTER_ADDR)", "10.0.0.7")
        for a in worker["args"]
    ]
    args = parser.parse_known_args(expanded)[0]
    assert (args.tensor_parallel_size, args.nnodes, args.node_rank, args.master_addr) == (
        4, 2, 1, "10.0.0.7"
    )  # fmt: skip
    single = parse_isvc(make_isvc("small", spec={"resources": {"gpus": 2}}))
    assert group_children(blueprint(single, None, CONFIG), [placed]) == []
    assert "--nnodes" not in render_flags(engine_config(single))


def test_a_template_whose_runtime_refused_its_settings_stays_at_zero(make_isvc: Builder) -> None:
    """A pod of the template that exited EX_CONFIG, quoting its runtime: the Deployment goes to
    zero and remembers which template was refused (its pods are gone next time); another
    template, or a pod that exited otherwise, is not refused."""
    isvc = parse_isvc(make_isvc("big", spec={"resources": {"gpus": 4}}))
    bp = blueprint(isvc, None, CONFIG)
    error = "tensor_parallel_size 4 does not split the model's heads"
    said = json.dumps({"level": "error", "message": "the engine failed to start", "error": error})

    def pod(exit_code: int, template: dict[str, Any]) -> PodInfo:
        ended = {"terminated": {"exitCode": exit_code, "message": f"loading\n{said}\n"}}
        return PodInfo.from_pod(
            {
                "metadata": {"name": "big-stable-x", "namespace": "default",
                             **copy.deepcopy(template["metadata"])},
                "spec": template["spec"],
                "status": {"phase": "Running", "containerStatuses": [
                    {"name": "runtime", "restartCount": 1, "lastState": ended,
                     "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]},
            }
        )  # fmt: skip

    why = refusal(bp, None, [pod(os.EX_CONFIG, bp.template)])
    assert why == error
    assert refusal(bp, None, [pod(1, bp.template)]) is None
    other = blueprint(parse_isvc(make_isvc("big", spec={"resources": {"gpus": 2}})), None, CONFIG)
    assert refusal(other, None, [pod(os.EX_CONFIG, bp.template)]) is None
    deployment = children_of(bp, 3, refused=why).deployment
    assert deployment["spec"]["replicas"] == 0
    assert refusal(bp, deployment, []) == why  # remembered by the live Deployment
    assert refusal(other, deployment, []) is None  # a changed spec serves again
    assert children_of(bp, 3).deployment["spec"]["replicas"] == 3


def test_speculative_decoding_is_vllms_flag_and_a_new_revision(make_isvc: Builder) -> None:
    from ladle.operator.revisions import revision_of, template_of

    speculative = {"method": "ngram", "numSpeculativeTokens": 6, "promptLookupMax": 4}
    spec = {"model": {"name": "m"}, "engine": {"speculative": speculative}}
    flags = render_flags(engine_config(parse_isvc(make_isvc(spec=spec))))
    at = flags.index("--speculative-config")
    assert json.loads(flags[at + 1]) == {
        "method": "ngram",
        "num_speculative_tokens": 6,
        "prompt_lookup_max": 4,
    }
    # An engine setting like any other: with spec.rollout, a canary.
    assert revision_of(template_of(spec, "img")) != revision_of(
        template_of({"model": {"name": "m"}}, "img")
    )
    drafted = {"method": "draft_model", "numSpeculativeTokens": 4, "quantization": "int8"}
    spec = {"model": {"name": "m"}, "engine": {"speculative": drafted}}
    flags = render_flags(engine_config(parse_isvc(make_isvc(spec=spec))))
    config = flags[flags.index("--speculative-config") + 1]
    assert SpeculativeConfig.parse(config) == SpeculativeConfig(
        "draft_model", 4, quantization="int8"
    )


@pytest.mark.parametrize(
    ("quantization", "flags", "label"),
    [
        ({}, [], "none"),
        ({"kvCache": "int8"}, ["--kv-cache-dtype", "int8"], "none+kv-int8"),
        ({"weights": "int8"}, ["--quantization", "int8"], "int8"),
        (
            {"weights": "int8", "groupSize": 32},
            ["--quantization", "int8", "--quantization-group-size", "32"],
            "int8-g32",
        ),
        (
            {"weights": "int4", "method": "rtn", "groupSize": 128, "kvCache": "int8"},
            [
                "--quantization", "int4",
                "--quantization-method", "rtn",
                "--quantization-group-size", "128",
                "--kv-cache-dtype", "int8",
            ],
            "int4-rtn-g128+kv-int8",
        ),
    ],
)  # fmt: skip
def test_quantization_becomes_runtime_flags(
    make_isvc: Builder, quantization: dict[str, Any], flags: list[str], label: str
) -> None:
    isvc = parse_isvc(make_isvc(spec={"quantization": quantization}))
    args = render_flags(engine_config(isvc))
    start = args.index("--scheduling-policy") + 2
    assert args[start : args.index("--drain-timeout")] == flags
    assert isvc.spec.quantization.label() == label
    # `ladle serve` takes exactly these flags, resolved as it resolves them.
    parser = build_parser()
    resolved = settings.resolve(settings.parse(parser, ["serve", *flags]), {}, parser)
    engine = EngineArgs.from_cli_args(resolved)
    assert (engine.quantization or "none", engine.kv_cache_dtype) == (
        isvc.spec.quantization.weights,
        isvc.spec.quantization.kv_cache,
    )


def test_objects_stored_with_the_old_string_quantization_still_parse(make_isvc: Builder) -> None:
    isvc = parse_isvc(make_isvc(spec={"quantization": "none"}))
    assert isvc.spec.quantization.label() == "none"
    assert "--quantization" not in render_flags(engine_config(isvc))


def test_pvc_source_mounts_the_claim_read_only(make_isvc: Builder) -> None:
    isvc = parse_isvc(
        make_isvc(spec={"model": {"name": "m", "source": {"pvc": {"claimName": "w", "path": "x"}}}})
    )
    children = desired_children(isvc, None, 1, CONFIG)
    pod = children.deployment["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "w", "readOnly": True}} in pod[
        "volumes"
    ]
    assert {"name": "model", "mountPath": "/models", "readOnly": True} in container(children)[
        "volumeMounts"
    ]


def test_image_source_and_api_key_secret(make_isvc: Builder) -> None:
    isvc = parse_isvc(
        make_isvc(
            spec={
                "model": {"name": "q", "source": {"image": {"path": "/opt/models/q"}}},
                "runtime": {"image": "registry.test/custom:2"},
                "apiKeySecret": {"name": "keys", "key": "token"},
            }
        )
    )
    children = desired_children(isvc, None, 1, CONFIG)
    ctr = container(children)
    assert ctr["image"] == "registry.test/custom:2"
    assert ctr["args"][ctr["args"].index("--model") + 1] == "/opt/models/q"
    assert ctr["args"][ctr["args"].index("--api-key-file") + 1] == "/etc/ladle/auth/api-key"
    volumes = children.deployment["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "api-key",
        "secret": {"secretName": "keys", "items": [{"key": "token", "path": "api-key"}]},
    } in volumes


def test_cpu_replicas_get_kv_cache_memory_in_bytes_and_no_gpu(make_isvc: Builder) -> None:
    isvc = parse_isvc(
        make_isvc(spec={"resources": {"gpus": 0}, "engine": {"kvCacheMemory": "2Gi"}})
    )
    ctr = container(desired_children(isvc, None, 1, CONFIG))
    assert ctr["args"][ctr["args"].index("--kv-cache-memory") + 1] == str(2 * 2**30)
    assert "nvidia.com/gpu" not in str(ctr["resources"])


def test_large_configuration_moves_into_a_config_map(make_isvc: Builder) -> None:
    long_path = "models/" + "x" * 300
    isvc = parse_isvc(
        make_isvc(
            spec={
                "model": {"name": "m", "source": {"pvc": {"claimName": "w", "path": long_path}}},
                "engine": {"maxModelLen": 4096},
            }
        )
    )
    children = desired_children(isvc, None, 1, CONFIG)
    assert children.config_map is not None
    assert children.all()[0] is children.config_map  # created before the pods that mount it
    assert children.config_map["metadata"]["name"] == "chat-stable-config"
    config = yaml.safe_load(children.config_map["data"]["config.yaml"])
    assert config == {
        "served-model-name": "m",
        "model": f"/models/{long_path}",
        "max-model-len": 4096,
        "scheduling-policy": "priority",
        "drain-timeout": 30,
    }
    ctr = container(children)
    assert ctr["args"] == [
        "--host", "0.0.0.0", "--port", "8000", "--config", "/etc/ladle/config/config.yaml"
    ]  # fmt: skip
    template = children.deployment["spec"]["template"]
    first_hash = template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]

    # A config change rolls the pods through the template annotation.
    isvc2 = parse_isvc(
        make_isvc(
            spec={
                "model": {"name": "m", "source": {"pvc": {"claimName": "w", "path": long_path}}},
                "engine": {"maxModelLen": 2048},
            }
        )
    )
    template2 = desired_children(isvc2, None, 1, CONFIG).deployment["spec"]["template"]
    assert template2["metadata"]["annotations"][CONFIG_HASH_ANNOTATION] != first_hash


def test_threshold_is_operator_configuration(make_isvc: Builder) -> None:
    isvc = parse_isvc(make_isvc())
    small = OperatorConfig(config_map_threshold_bytes=10)
    assert desired_children(isvc, None, 1, small).config_map is not None
    assert desired_children(isvc, None, 1, CONFIG).config_map is None


def test_service_fronts_every_variant_and_pdb_keeps_drains_moving(make_isvc: Builder) -> None:
    children = desired_children(parse_isvc(make_isvc()), None, 2, CONFIG)
    service = desired_service(parse_isvc(make_isvc()))
    assert service["spec"]["selector"] == {"ladle.dev/inferenceservice": "chat"}
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}
    ]
    assert children.pdb is not None
    assert children.pdb["spec"]["maxUnavailable"] == 1
    assert children.pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_no_disruption_budget_below_two_replicas(make_isvc: Builder) -> None:
    # maxUnavailable 1 of 1 would allow every eviction anyway; 0 would block drains forever.
    children = desired_children(parse_isvc(make_isvc()), None, 1, CONFIG)
    assert children.pdb is None


def test_the_rollout_strategy_follows_the_pools_headroom(make_isvc: Builder) -> None:
    isvc = parse_isvc(make_isvc(spec={"replicas": 2}))
    surge = desired_children(isvc, None, 2, CONFIG).deployment["spec"]["strategy"]
    assert surge["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    replace = desired_children(isvc, None, 2, CONFIG, surge=False).deployment["spec"]["strategy"]
    assert replace["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}


def test_the_deployment_carries_a_digest_of_its_pod_template(
    make_isvc: Builder, make_pool: Builder
) -> None:
    pool = parse_pool(make_pool())
    isvc = parse_isvc(make_isvc(spec={"gpuPool": "h200"}))
    deployment = desired_children(isvc, pool.spec, 1, CONFIG).deployment
    digest = deployment["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION]
    assert digest == object_digest(deployment["spec"]["template"])
    # Replicas and strategy are not the template: they never roll the pods.
    other = desired_children(isvc, pool.spec, 3, CONFIG, surge=False).deployment
    assert other["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] == digest
    edited = parse_isvc(make_isvc(spec={"gpuPool": "h200", "engine": {"maxModelLen": 64}}))
    changed = desired_children(edited, pool.spec, 1, CONFIG).deployment
    assert changed["metadata"]["annotations"][TEMPLATE_HASH_ANNOTATION] != digest
    # Pods name their pool, so that pods still draining count against its quota.
    assert deployment["spec"]["template"]["metadata"]["labels"]["ladle.dev/gpupool"] == "h200"
    assert "ladle.dev/gpupool" not in deployment["spec"]["selector"]["matchLabels"]


# ---- environment profiles and profiling (issue 17) ----------------------------------------


def profiling_on(obj: dict[str, Any], value: str) -> dict[str, Any]:
    obj["metadata"]["annotations"] = {"ladle.dev/profiling": value}
    return obj


def probe_timings(ctr: dict[str, Any], name: str) -> tuple[int, int, int]:
    probe = ctr[name]
    return probe["periodSeconds"], probe["timeoutSeconds"], probe["failureThreshold"]


def test_the_operators_env_profile_names_are_ladle_serves() -> None:
    from ladle.operator.cli import RUNTIME_ENV_PROFILES
    from ladle.operator.runtime_pod import RUNTIME_PROBES
    from ladle.runtime.server.profiles import ENV_PROFILES

    assert tuple(ENV_PROFILES) == RUNTIME_ENV_PROFILES
    assert set(RUNTIME_PROBES) == {None, *ENV_PROFILES}


def test_each_env_profile_changes_only_the_flag_and_its_probe_timings(
    make_isvc: Builder,
) -> None:
    """What each --runtime-env-profile renders, diffed against no profile: `--env-profile` in
    the pod's args (a layer under every other flag, so the spec's engine fields still win) and
    the profile's probe timings; nothing else in the pod template."""
    isvc = parse_isvc(make_isvc(spec={"engine": {"maxWaitingRequests": 8}}))
    plain = desired_children(isvc, None, 1, CONFIG).deployment["spec"]["template"]
    seen: dict[str | None, tuple[tuple[int, int, int], tuple[int, int, int]]] = {}
    for profile in (None, "dev", "staging", "prod"):
        config = OperatorConfig(runtime_image=CONFIG.runtime_image, runtime_env_profile=profile)
        children = desired_children(isvc, None, 1, config)
        ctr = container(children)
        args = ctr["args"]
        if profile is None:
            assert "--env-profile" not in args
        else:
            assert args[args.index("--env-profile") + 1] == profile
            assert args[-2:] == ["--env-profile", profile]
        # The spec's own setting stays an explicit flag, which beats the profile's default.
        assert args[args.index("--max-waiting-requests") + 1] == "8"
        seen[profile] = (probe_timings(ctr, "livenessProbe"), probe_timings(ctr, "readinessProbe"))
        template = children.deployment["spec"]["template"]
        rest = copy.deepcopy(template)
        base = copy.deepcopy(plain)
        for t in (rest, base):
            c = t["spec"]["containers"][0]
            c["args"] = [a for a in c["args"] if a not in ("--env-profile", profile)]
            del c["livenessProbe"], c["readinessProbe"]
        assert rest == base
    assert seen == {
        None: ((10, 5, 3), (5, 3, 2)),
        "dev": ((30, 10, 20), (5, 3, 2)),  # ten minutes for a process paused in a debugger
        "staging": ((10, 5, 3), (5, 3, 2)),
        "prod": ((10, 5, 3), (5, 3, 2)),
    }


def test_the_env_profile_rides_in_the_config_map_when_flags_move_there(
    make_isvc: Builder,
) -> None:
    config = OperatorConfig(config_map_threshold_bytes=0, runtime_env_profile="prod")
    children = desired_children(parse_isvc(make_isvc()), None, 1, config)
    assert children.config_map is not None
    rendered = yaml.safe_load(children.config_map["data"]["config.yaml"])
    assert rendered["env-profile"] == "prod"
    assert "--env-profile" not in container(children)["args"]


KEYED = {"apiKeySecret": {"name": "keys", "key": "token"}}


def test_the_profiling_annotation_adds_a_profile_dir_on_a_bounded_empty_dir(
    make_isvc: Builder,
) -> None:
    plain = desired_children(parse_isvc(make_isvc(spec=KEYED)), None, 1, CONFIG)
    isvc = parse_isvc(profiling_on(make_isvc(spec=KEYED), "enabled"))
    assert isvc.meta.annotations == {"ladle.dev/profiling": "enabled"}
    assert profiling(isvc) == Profiling(True)
    children = desired_children(isvc, None, 1, CONFIG)
    ctr = container(children)
    args = ctr["args"]
    assert args[args.index("--profile-dir") + 1] == "/var/lib/ladle/profiles"
    assert args[args.index("--api-key-file") + 1] == "/etc/ladle/auth/api-key"
    pod = children.deployment["spec"]["template"]["spec"]
    assert {"name": "profiles", "emptyDir": {"sizeLimit": "1Gi"}} in pod["volumes"]
    assert {"name": "profiles", "mountPath": "/var/lib/ladle/profiles"} in ctr["volumeMounts"]
    # A new pod template: the pods restart with the flag (and again when it is removed).
    assert template_hash(children.deployment) != template_hash(plain.deployment)
    off = profiling_on(make_isvc(spec=KEYED), "disabled")
    assert desired_children(parse_isvc(off), None, 1, CONFIG).deployment == plain.deployment


@pytest.mark.parametrize(
    ("spec", "value", "reason"),
    [
        ({}, "enabled", "ProfilingNeedsAPIKey"),
        (KEYED, "yes", "InvalidProfilingAnnotation"),
    ],
)
def test_profiling_that_cannot_be_is_off_and_says_why(
    make_isvc: Builder, spec: dict[str, Any], value: str, reason: str
) -> None:
    isvc = parse_isvc(profiling_on(make_isvc(spec=spec), value))
    result = profiling(isvc)
    assert not result.enabled
    assert result.problem is not None
    assert result.problem[0] == reason
    assert "profiling stays off" in result.problem[1]
    ctr = container(desired_children(isvc, None, 1, CONFIG))
    assert "--profile-dir" not in ctr["args"]
    assert "profiles" not in [m["name"] for m in ctr["volumeMounts"]]


def with_adapters(make_isvc: Builder, adapters: list[dict[str, Any]], **engine: Any) -> Any:
    model = {"name": "m", "source": {"pvc": {"claimName": "w", "path": "base"}}}
    return parse_isvc(make_isvc(spec={"model": model, "adapters": adapters, "engine": engine}))


def test_adapters_run_the_pods_with_lora_following_a_config_map(make_isvc: Builder) -> None:
    adapters = [
        {"name": "sql", "source": {"pvc": {"claimName": "w", "path": "loras/sql"}}},
        {"name": "fr", "source": {"pvc": {"claimName": "extra", "path": "fr"}}},
        {"name": "baked", "source": {"image": {"path": "/opt/adapters/baked"}}},
    ]
    isvc = with_adapters(make_isvc, adapters, maxLoras=2, maxLoraRank=32)
    children = desired_children(isvc, None, 1, CONFIG)
    args = container(children)["args"]
    assert "--enable-lora" in args
    assert args[args.index("--lora-modules-file") + 1] == "/etc/ladle/adapters/adapters.yaml"
    assert args[args.index("--max-loras") + 1] == "2"
    assert args[args.index("--max-lora-rank") + 1] == "32"
    # `ladle serve` takes the LoRA flags as the engine's (the file is the pod's, not here).
    lora = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "32"]
    assert all(flag in args for flag in lora)
    parser = build_parser()
    engine = EngineArgs.from_cli_args(
        settings.resolve(settings.parse(parser, ["serve", *lora]), {}, parser)
    )
    assert (engine.enable_lora, engine.max_loras, engine.max_lora_rank) == (True, 2, 32)
    assert children.adapters is not None
    listed = json.loads(children.adapters["data"]["adapters.yaml"])
    assert listed == [
        {"name": "sql", "path": "/models/loras/sql"},  # on the model's claim, mounted already
        {"name": "fr", "path": "/adapters/extra/fr"},
        {"name": "baked", "path": "/opt/adapters/baked"},
    ]
    assert children.adapters["metadata"]["name"] == "chat-stable-adapters"
    assert children.all()[0] is children.adapters
    pod = children.deployment["spec"]["template"]["spec"]
    mounts = container(children)["volumeMounts"]
    # Another claim than the model's is a volume of its own.
    assert {"name": "adapters-0", "mountPath": "/adapters/extra", "readOnly": True} in mounts
    assert {
        "name": "adapters-0",
        "persistentVolumeClaim": {"claimName": "extra", "readOnly": True},
    } in pod["volumes"]
    assert {"name": "adapters", "configMap": {"name": "chat-stable-adapters"}} in pod["volumes"]


def test_an_adapter_on_a_mounted_claim_changes_the_list_not_the_pods(make_isvc: Builder) -> None:
    one = [{"name": "sql", "source": {"pvc": {"claimName": "w", "path": "sql"}}}]
    two = [*one, {"name": "fr", "source": {"pvc": {"claimName": "w", "path": "fr"}}}]
    other_claim = [*one, {"name": "fr", "source": {"pvc": {"claimName": "new", "path": "fr"}}}]
    before, after, rolled = (
        desired_children(with_adapters(make_isvc, a), None, 1, CONFIG)
        for a in (one, two, other_claim)
    )
    assert template_hash(before.deployment) == template_hash(after.deployment)
    assert before.adapters != after.adapters
    assert template_hash(rolled.deployment) != template_hash(before.deployment)
    # Even an empty list turns LoRA on, so that the first adapter needs no restart.
    empty = desired_children(with_adapters(make_isvc, []), None, 1, CONFIG)
    assert template_hash(empty.deployment) == template_hash(before.deployment)
    assert "--enable-lora" in container(empty)["args"]
    assert empty.adapters is not None


def test_without_adapters_lora_is_off_and_its_config_map_absent(make_isvc: Builder) -> None:
    children = desired_children(parse_isvc(make_isvc()), None, 1, CONFIG)
    assert "--enable-lora" not in container(children)["args"]
    assert children.adapters is None
    assert all(child["kind"] != "ConfigMap" for child in children.all())
