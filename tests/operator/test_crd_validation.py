"""The CRDs reject bad objects at apply time, with messages a person understands.

Each case goes through the real kubectl to the real API server: structural schema, defaults,
CEL rules, transition rules and the scale subresource. No operator is needed for any of it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from kube_harness import Kube

ROOT = Path(__file__).resolve().parents[2]

VALID_ISVC: dict[str, Any] = {
    "apiVersion": "ladle.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "chat"},
    "spec": {"model": {"name": "smollm2"}},
}
VALID_POOL: dict[str, Any] = {
    "apiVersion": "ladle.dev/v1alpha1",
    "kind": "GPUPool",
    "metadata": {"name": "validation-pool"},
    "spec": {"nodeSelector": {"nvidia.com/gpu.present": "true"}},
}


def with_spec(base: dict[str, Any], **spec: Any) -> dict[str, Any]:
    obj = copy.deepcopy(base)
    obj["spec"].update(spec)
    return obj


def speculative(fields: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """A valid service but for its engine.speculative (and ``spec``'s other fields)."""
    return with_spec(VALID_ISVC, engine={"speculative": fields}, **spec)


def adapter(name: str, **source: Any) -> dict[str, Any]:
    return {"name": name, "source": source or {"pvc": {"claimName": "loras", "path": name}}}


ISVC_CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "adapter-named-as-the-model",
        with_spec(VALID_ISVC, adapters=[adapter("smollm2")]),
        "adapters[].name must differ from model.name",
    ),
    (
        "adapter-twice",
        with_spec(VALID_ISVC, adapters=[adapter("sql"), adapter("sql")]),
        'spec.adapters[1]: Duplicate value: {"name":"sql"}',
    ),
    (
        "adapter-with-two-sources",
        with_spec(
            VALID_ISVC,
            adapters=[adapter("sql", image={"path": "/a"}, pvc={"claimName": "c", "path": "a"})],
        ),
        "adapters[].source must set exactly one of pvc or image",
    ),
    (
        "adapter-path-escaping-its-claim",
        with_spec(VALID_ISVC, adapters=[adapter("sql", pvc={"claimName": "c", "path": "../x"})]),
        "adapters[].source.pvc.path must be relative to the volume root",
    ),
    (
        "adapter-builtin",
        with_spec(VALID_ISVC, adapters=[adapter("sql", builtin={})]),
        'unknown field "spec.adapters[0].source.builtin"',
    ),
    (
        "speculative-unknown-method",
        speculative({"method": "eagle", "numSpeculativeTokens": 4}),
        'spec.engine.speculative.method: Unsupported value: "eagle"',
    ),
    (
        "speculative-no-tokens",
        speculative({"method": "ngram", "numSpeculativeTokens": 0}),
        "spec.engine.speculative.numSpeculativeTokens: Invalid value: 0",
    ),
    (
        "speculative-too-many-tokens",
        speculative({"method": "ngram", "numSpeculativeTokens": 17}),
        "should be less than or equal to 16",
    ),
    (
        "speculative-lookup-inverted",
        speculative(
            {
                "method": "ngram",
                "numSpeculativeTokens": 4,
                "promptLookupMin": 5,
                "promptLookupMax": 2,
            }
        ),
        "promptLookupMin must not exceed promptLookupMax",
    ),
    (
        "speculative-lookup-for-a-draft-model",
        speculative({"method": "draft_model", "numSpeculativeTokens": 4, "promptLookupMax": 2}),
        "promptLookupMin and promptLookupMax apply to method ngram only",
    ),
    (
        "speculative-quantization-for-ngram",
        speculative({"method": "ngram", "numSpeculativeTokens": 4, "quantization": "int4"}),
        "quantization applies to method draft_model only",
    ),
    (
        "speculative-draft-model-split",
        speculative({"method": "draft_model", "numSpeculativeTokens": 4}, resources={"gpus": 2}),
        "the draft model does not run split across GPUs yet",
    ),
    (
        "lora-slots-without-adapters",
        with_spec(VALID_ISVC, engine={"maxLoras": 4}),
        "only pods with adapters have: set adapters",
    ),
    (
        "autoscaling-without-max",
        with_spec(VALID_ISVC, autoscaling={"targetConcurrency": 8}),
        "spec.maxReplicas: Required value: autoscaling needs maxReplicas",
    ),
    (
        "autoscaling-kv-target-above-one",
        with_spec(VALID_ISVC, maxReplicas=3, autoscaling={"targetKVCacheUsage": 1.5}),
        "spec.autoscaling.targetKVCacheUsage: Invalid value",
    ),
    (
        "autoscaling-tiny-window",
        with_spec(VALID_ISVC, maxReplicas=3, autoscaling={"stableWindowSeconds": 2}),
        "spec.autoscaling.stableWindowSeconds: Invalid value",
    ),
    (
        "name-with-a-dot",
        {**copy.deepcopy(VALID_ISVC), "metadata": {"name": "chat.v2"}},
        "metadata.name must be a DNS-1035 label",
    ),
    ("no-model", {**VALID_ISVC, "spec": {}}, "spec.model: Required value"),
    (
        "blank-model-name",
        with_spec(VALID_ISVC, model={"name": "my model"}),
        "model.name must not contain whitespace",
    ),
    (
        "two-sources",
        with_spec(
            VALID_ISVC, model={"name": "m", "source": {"builtin": {}, "image": {"path": "/m"}}}
        ),
        "model.source must set exactly one of builtin, pvc or image",
    ),
    (
        "absolute-pvc-path",
        with_spec(
            VALID_ISVC, model={"name": "m", "source": {"pvc": {"claimName": "c", "path": "/etc"}}}
        ),
        "model.source.pvc.path must be relative to the volume root and must not contain '..'",
    ),
    (
        "escaping-pvc-path",
        with_spec(
            VALID_ISVC,
            model={"name": "m", "source": {"pvc": {"claimName": "c", "path": "a/../../etc"}}},
        ),
        "must not contain '..'",
    ),
    (
        "relative-image-path",
        with_spec(VALID_ISVC, model={"name": "m", "source": {"image": {"path": "models/m"}}}),
        "model.source.image.path must be an absolute path",
    ),
    (
        "quantization-as-a-string",
        with_spec(VALID_ISVC, quantization="int8"),
        'spec.quantization: Invalid value: "string": spec.quantization in body must be of '
        "type object",
    ),
    (
        "unsupported-weights",
        with_spec(VALID_ISVC, quantization={"weights": "int2"}),
        'spec.quantization.weights: Unsupported value: "int2": supported values: "none", '
        '"int8", "int4"',
    ),
    (
        "unsupported-kv-cache",
        with_spec(VALID_ISVC, quantization={"kvCache": "fp8"}),
        'spec.quantization.kvCache: Unsupported value: "fp8": supported values: "auto", '
        '"float16", "int8"',
    ),
    (
        "group-size-with-default-weights",
        with_spec(VALID_ISVC, quantization={"groupSize": 128}),
        "quantization.groupSize needs weights int8 or int4",
    ),
    (
        "group-size-not-a-multiple-of-32",
        with_spec(VALID_ISVC, quantization={"weights": "int4", "groupSize": 48}),
        "spec.quantization.groupSize in body should be a multiple of 32",
    ),
    (
        "method-without-quantized-weights",
        with_spec(VALID_ISVC, quantization={"weights": "none", "method": "awq", "kvCache": "int8"}),
        "quantization.method needs weights int8 or int4",
    ),
    (
        "unknown-method",
        with_spec(VALID_ISVC, quantization={"weights": "int4", "method": "hqq"}),
        'spec.quantization.method: Unsupported value: "hqq": supported values: "rtn", "awq", '
        '"gptq", "awq-gptq"',
    ),
    (
        "replicas-above-max",
        with_spec(VALID_ISVC, replicas=5, maxReplicas=4),
        "spec.replicas: Invalid value: replicas must be at most maxReplicas (4)",
    ),
    (
        "replicas-below-min",
        with_spec(VALID_ISVC, replicas=1, minReplicas=2),
        "spec.replicas: Invalid value: replicas must be at least minReplicas (2)",
    ),
    (
        "min-above-max",
        with_spec(VALID_ISVC, replicas=3, minReplicas=3, maxReplicas=2),
        "minReplicas (3) must not exceed maxReplicas (2)",
    ),
    (
        "bad-cpu",
        with_spec(VALID_ISVC, resources={"cpu": "two"}),
        "resources.cpu must be a positive quantity such as 2 or 500m",
    ),
    (
        "negative-memory",
        with_spec(VALID_ISVC, resources={"memory": "-1Gi"}),
        "resources.memory must be a positive quantity such as 16Gi",
    ),
    (
        "three-gpus",
        with_spec(VALID_ISVC, resources={"gpus": 3}),
        "resources.gpus is 3: a replica uses 0 (CPU), 1, 2, 4 or 8 GPUs, and more than one "
        "splits the model over them (a power of two, up to one node's 8)",
    ),
    (
        "split-model-with-adapters",
        with_spec(VALID_ISVC, resources={"gpus": 2}, adapters=[]),
        "spec.adapters: Invalid value: adapters need resources.gpus of 0 or 1",
    ),
    (
        "split-model-gptq",
        with_spec(
            VALID_ISVC, resources={"gpus": 4}, quantization={"weights": "int4", "method": "gptq"}
        ),
        "quantization.method gptq and awq-gptq round each layer on the whole model's activations",
    ),
    (
        "group-with-adapters",
        with_spec(VALID_ISVC, parallelism={"nodes": 2}, adapters=[]),
        "spec.adapters: Invalid value: adapters need resources.gpus of 0 or 1 and no "
        "parallelism.nodes",
    ),
    (
        "group-tensor-not-every-gpu",
        with_spec(VALID_ISVC, resources={"gpus": 2}, parallelism={"nodes": 2, "tensor": 2}),
        "spec.parallelism.tensor: Invalid value: parallelism.tensor is 2: it must be "
        "resources.gpus (2, per pod) times parallelism.nodes (2), every GPU of the group",
    ),
    (
        "group-of-too-many-nodes",
        with_spec(VALID_ISVC, parallelism={"nodes": 17}),
        "spec.parallelism.nodes in body should be less than or equal to 16",
    ),
    (
        # The CLI's rule too: 512m is half a byte (it became "--kv-cache-memory 1"), not 512 MiB.
        "kv-cache-memory-in-milli",
        with_spec(VALID_ISVC, resources={"gpus": 0}, engine={"kvCacheMemory": "512m"}),
        "engine.kvCacheMemory is 512m: 'm' means milli in a quantity (a thousandth of a byte); "
        "write Mi or M",
    ),
    (
        "kv-cache-memory-in-part-bytes",
        with_spec(VALID_ISVC, resources={"gpus": 0}, engine={"kvCacheMemory": "1.5"}),
        "engine.kvCacheMemory is 1.5: a size in bytes must be whole, such as 4Gi or 512Mi",
    ),
    (
        "memory-in-milli",
        with_spec(VALID_ISVC, resources={"memory": "16000m"}),
        "resources.memory is 16000m: 'm' means milli in a quantity",
    ),
    (
        "kv-cache-memory-on-gpu",
        with_spec(VALID_ISVC, engine={"kvCacheMemory": "4Gi"}),
        "engine.kvCacheMemory sizes the KV cache of CPU replicas (resources.gpus: 0)",
    ),
    (
        "gpu-memory-utilization-on-cpu",
        with_spec(VALID_ISVC, resources={"gpus": 0}, engine={"gpuMemoryUtilization": 0.9}),
        "engine.gpuMemoryUtilization needs GPUs (resources.gpus > 0)",
    ),
    (
        "gpu-memory-utilization-above-one",
        with_spec(VALID_ISVC, engine={"gpuMemoryUtilization": 1.5}),
        "gpuMemoryUtilization in body should be less than or equal to 1",
    ),
    (
        "zero-gpu-memory-utilization",
        with_spec(VALID_ISVC, engine={"gpuMemoryUtilization": 0}),
        "gpuMemoryUtilization in body should be greater than 0",
    ),
    (
        "odd-block-size",
        with_spec(VALID_ISVC, engine={"blockSize": 12}),
        "spec.engine.blockSize: Unsupported value: 12",
    ),
    (
        "unknown-dtype",
        with_spec(VALID_ISVC, engine={"dtype": "fp8"}),
        'spec.engine.dtype: Unsupported value: "fp8"',
    ),
    (
        "token-budget-below-batch",
        with_spec(VALID_ISVC, engine={"maxNumSeqs": 256, "maxNumBatchedTokens": 128}),
        "engine.maxNumBatchedTokens must be at least engine.maxNumSeqs",
    ),
    (
        "api-key-secret-without-name",
        with_spec(VALID_ISVC, apiKeySecret={"key": "k"}),
        "spec.apiKeySecret.name: Required value",
    ),
    (
        "unknown-field",
        with_spec(VALID_ISVC, replica=2),
        'unknown field "spec.replica"',
    ),
    (
        "fallback-to-itself",
        with_spec(VALID_ISVC, fallback="chat"),
        "spec.fallback names this InferenceService itself",
    ),
    (
        "fallback-not-a-name",
        with_spec(VALID_ISVC, fallback="Backup Model"),
        "spec.fallback must be the name of an InferenceService",
    ),
    (
        "first-token-after-the-deadline",
        with_spec(VALID_ISVC, timeouts={"requestSeconds": 10, "firstTokenSeconds": 30}),
        "timeouts.firstTokenSeconds must not exceed timeouts.requestSeconds",
    ),
    (
        "three-retries",
        with_spec(VALID_ISVC, routing={"retries": 3}),
        "spec.routing.retries in body should be less than or equal to 2",
    ),
    (
        "load-factor-below-one",
        with_spec(VALID_ISVC, routing={"loadFactorPercent": 90}),
        "spec.routing.loadFactorPercent in body should be greater than or equal to 100",
    ),
    (
        "rollout-steps-not-increasing",
        with_spec(VALID_ISVC, rollout={"steps": [50, 25, 100]}),
        "rollout.steps must be strictly increasing, for example [5, 25, 50, 100]",
    ),
    (
        "rollout-step-above-100",
        with_spec(VALID_ISVC, rollout={"steps": [50, 150]}),
        "rollout.steps are traffic weights in percent, from 1 to 100",
    ),
    (
        "rollout-deadline-shorter-than-an-interval",
        with_spec(
            VALID_ISVC,
            rollout={"steps": [50], "intervalSeconds": 120, "progressDeadlineSeconds": 60},
        ),
        "rollout.progressDeadlineSeconds (60) must exceed rollout.intervalSeconds (120)",
    ),
    (
        "rollout-quality-gate-behind-an-api-key",
        with_spec(VALID_ISVC, apiKeySecret={"name": "keys"}, rollout={"steps": [50]}),
        "set rollout.analysis.quality.enabled to false",
    ),
]

POOL_CASES: list[tuple[str, dict[str, Any], str]] = [
    (
        "undomained-resource",
        with_spec(VALID_POOL, resourceName="gpu"),
        "resourceName must be a domain-prefixed resource name such as nvidia.com/gpu",
    ),
    (
        "product-with-space",
        with_spec(VALID_POOL, product="NVIDIA H200"),
        "product must be a valid label value, such as NVIDIA-H100-80GB-HBM3",
    ),
    (
        "product-twice",
        with_spec(VALID_POOL, product="A", nodeSelector={"nvidia.com/gpu.product": "B"}),
        "set the GPU product in product or in nodeSelector['nvidia.com/gpu.product'], not both",
    ),
    (
        "bad-selector-key",
        with_spec(VALID_POOL, nodeSelector={"bad key": "x"}),
        "nodeSelector keys must be valid label keys",
    ),
    (
        "exists-with-value",
        with_spec(VALID_POOL, tolerations=[{"key": "gpu", "operator": "Exists", "value": "x"}]),
        "a toleration with operator Exists must not set a value",
    ),
    (
        "negative-quota",
        with_spec(VALID_POOL, quota={"gpus": -1}),
        "spec.quota.gpus in body should be greater than or equal to 0",
    ),
    (
        "selector-in-without-values",
        with_spec(
            VALID_POOL, namespaceSelector={"matchExpressions": [{"key": "t", "operator": "In"}]}
        ),
        "namespaceSelector expressions with In or NotIn need values",
    ),
    (
        "selector-unknown-operator",
        with_spec(
            VALID_POOL,
            namespaceSelector={
                "matchExpressions": [{"key": "t", "operator": "Gt", "values": ["1"]}]
            },
        ),
        'Unsupported value: "Gt"',
    ),
]


def rejected(kube: Kube, obj: dict[str, Any], namespace: str | None) -> str:
    scope = ["-n", namespace] if namespace else []
    result = kube.kubectl("apply", *scope, "-f", "-", stdin=yaml.safe_dump(obj))
    assert result.returncode != 0, f"accepted: {obj}"
    return result.stderr


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_invalid_inference_services_are_rejected_with_their_message(
    kube: Kube, k8s_namespace: str
) -> None:
    failures = []
    for case, obj, message in ISVC_CASES:
        error = rejected(kube, obj, k8s_namespace)
        if message not in error:
            failures.append(f"{case}: expected {message!r} in {error!r}")
    assert not failures, "\n".join(failures)
    listed = kube.custom.list_namespaced_custom_object(
        "ladle.dev", "v1alpha1", k8s_namespace, "inferenceservices"
    )
    assert listed["items"] == []


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_invalid_gpu_pools_are_rejected_with_their_message(kube: Kube) -> None:
    failures = []
    for case, obj, message in POOL_CASES:
        error = rejected(kube, obj, None)
        if message not in error:
            failures.append(f"{case}: expected {message!r} in {error!r}")
    assert not failures, "\n".join(failures)


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_defaults_fill_a_minimal_inference_service(kube: Kube, k8s_namespace: str) -> None:
    kube.apply(yaml.safe_dump(VALID_ISVC), k8s_namespace)
    spec = kube.isvc(k8s_namespace, "chat")["spec"]
    assert spec == {
        "model": {"name": "smollm2", "source": {"builtin": {}}},
        "quantization": {"weights": "none", "kvCache": "auto"},
        "runtime": {"startupTimeoutSeconds": 600},
        "engine": {"drainTimeoutSeconds": 30},
        "resources": {"gpus": 1},
        "replicas": 1,
        "minReplicas": 1,
        "routing": {
            "prefixAffinity": True,
            "prefixChars": 100,
            "loadFactorPercent": 125,
            "retries": 2,
            "outlierDetection": {
                "consecutiveErrors": 5,
                "baseEjectionSeconds": 30,
                "intervalSeconds": 10,
                "maxEjectionPercent": 10,
            },
        },
        "circuitBreaker": {
            "enabled": True,
            "failureRatePercent": 50,
            "windowSeconds": 30,
            "minimumCalls": 20,
            "openSeconds": 30,
            "halfOpenProbes": 3,
            "noReadyPodsSeconds": 30,
            "countRateLimited": False,
        },
        "timeouts": {"requestSeconds": 600, "firstTokenSeconds": 60, "scaleFromZeroSeconds": 120},
    }


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_quantized_variants_are_accepted_as_written(kube: Kube, k8s_namespace: str) -> None:
    choices = {
        "int4-awq": {"weights": "int4", "method": "awq", "groupSize": 128, "kvCache": "int8"},
        "int8-kv": {"weights": "int8", "kvCache": "int8"},
        "int8-groups": {"weights": "int8", "groupSize": 32},
        "kv-only": {"kvCache": "int8"},
    }
    for name, quantization in choices.items():
        obj = with_spec(VALID_ISVC, quantization=quantization)
        obj["metadata"]["name"] = name
        kube.apply(yaml.safe_dump(obj), k8s_namespace)
        stored = kube.isvc(k8s_namespace, name)["spec"]["quantization"]
        assert stored == {"weights": "none", "kvCache": "auto", **quantization}


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_speculative_decoding_is_accepted_as_written(kube: Kube, k8s_namespace: str) -> None:
    speculative = {"method": "ngram", "numSpeculativeTokens": 6, "promptLookupMax": 4}
    obj = with_spec(VALID_ISVC, engine={"speculative": speculative})
    obj["metadata"]["name"] = "speculative"
    kube.apply(yaml.safe_dump(obj), k8s_namespace)
    assert kube.isvc(k8s_namespace, "speculative")["spec"]["engine"]["speculative"] == speculative


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_adapters_are_accepted_as_written(kube: Kube, k8s_namespace: str) -> None:
    adapters = [adapter("sql"), adapter("chat-fr", image={"path": "/adapters/fr"})]
    obj = with_spec(VALID_ISVC, adapters=adapters, engine={"maxLoras": 2, "maxLoraRank": 32})
    obj["metadata"]["name"] = "with-adapters"
    kube.apply(yaml.safe_dump(obj), k8s_namespace)
    spec = kube.isvc(k8s_namespace, "with-adapters")["spec"]
    assert spec["adapters"] == adapters
    assert (spec["engine"]["maxLoras"], spec["engine"]["maxLoraRank"]) == (2, 32)


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_a_group_over_nodes_is_accepted_with_its_tensor_size(
    kube: Kube, k8s_namespace: str
) -> None:
    obj = with_spec(VALID_ISVC, resources={"gpus": 4}, parallelism={"nodes": 2, "tensor": 8})
    obj["metadata"]["name"] = "group"
    kube.apply(yaml.safe_dump(obj), k8s_namespace)
    assert kube.isvc(k8s_namespace, "group")["spec"]["parallelism"] == {"nodes": 2, "tensor": 8}
    # On CPUs: one rank per pod, its KV cache sized as any CPU replica's.
    cpus = with_spec(
        VALID_ISVC,
        resources={"gpus": 0},
        parallelism={"nodes": 3, "tensor": 3},
        engine={"kvCacheMemory": "256Mi"},
    )
    cpus["metadata"]["name"] = "cpu-group"
    kube.apply(yaml.safe_dump(cpus), k8s_namespace)
    assert kube.isvc(k8s_namespace, "cpu-group")["spec"]["parallelism"]["nodes"] == 3


@pytest.mark.usefixtures("ladle_chart")
def test_pool_and_resource_name_are_immutable(kube: Kube, k8s_namespace: str) -> None:
    pool_name = f"{k8s_namespace}-pool"
    pool = with_spec(VALID_POOL)
    pool["metadata"]["name"] = pool_name
    kube.apply(yaml.safe_dump(pool))
    try:
        moved = with_spec(pool, resourceName="example.com/gpu")
        assert "resourceName is immutable" in rejected(kube, moved, None)

        isvc = with_spec(VALID_ISVC, gpuPool=pool_name)
        kube.apply(yaml.safe_dump(isvc), k8s_namespace)
        for changed in (with_spec(isvc, gpuPool="elsewhere"), copy.deepcopy(VALID_ISVC)):
            assert "gpuPool is immutable" in rejected(kube, changed, k8s_namespace)
        # Other fields stay editable.
        kube.apply(yaml.safe_dump(with_spec(isvc, replicas=2)), k8s_namespace)
    finally:
        kube.kubectl("delete", "gpupool", pool_name, "--wait=false")


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_scale_subresource_obeys_the_replica_bounds(kube: Kube, k8s_namespace: str) -> None:
    kube.apply(yaml.safe_dump(with_spec(VALID_ISVC, maxReplicas=3)), k8s_namespace)
    scaled = kube.kubectl("scale", "-n", k8s_namespace, "lisvc/chat", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    assert kube.isvc(k8s_namespace, "chat")["spec"]["replicas"] == 3
    too_far = kube.kubectl("scale", "-n", k8s_namespace, "lisvc/chat", "--replicas=4")
    assert too_far.returncode != 0
    assert "replicas must be at most maxReplicas (3)" in too_far.stderr


def schema_defaults(node: dict[str, Any], path: str = "") -> list[tuple[str, Any, str]]:
    """(field path, default, description) of every schema field with a default."""
    found = []
    if "default" in node:
        found.append((path, node["default"], " ".join(str(node.get("description", "")).split())))
    for name, child in (node.get("properties") or {}).items():
        found += schema_defaults(child, f"{path}.{name}" if path else name)
    return found


def test_every_default_is_stated_where_kubectl_explain_shows_it() -> None:
    """kubectl explain prints descriptions (and enums) but not defaults, so each field with a
    default says it in its description, in one form: "Defaults to X."."""
    missing = []
    for name in ("ladle.dev_inferenceservices.yaml", "ladle.dev_gpupools.yaml"):
        crd = yaml.safe_load((ROOT / "crds" / name).read_text())
        schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, default, description in schema_defaults(schema):
            shown = "{}" if default == {} else default
            if isinstance(default, bool):
                shown = "true" if default else "false"
            if isinstance(default, dict) and default:
                shown = ", ".join(f"{k}: {'{}' if v == {} else v}" for k, v in default.items())
            if f"Defaults to {shown}." not in description:
                missing.append(f"{name} {path}: default {default!r} not in {description!r}")
    assert not missing, "\n".join(missing)


@pytest.mark.cluster
@pytest.mark.usefixtures("ladle_chart")
def test_kubectl_explain_shows_the_defaults(kube: Kube) -> None:
    for field, default in (
        ("lisvc.spec.minReplicas", "Defaults to 1."),
        ("lisvc.spec.apiKeySecret.key", "Defaults to api-key."),
        ("gpool.spec.resourceName", "Defaults to nvidia.com/gpu."),
    ):
        explained = kube.kubectl("explain", field)
        assert explained.returncode == 0, explained.stderr
        assert default in " ".join(explained.stdout.split()), field
