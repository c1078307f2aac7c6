"""The API's names: group, kinds, labels, annotations and variants, as every component and the
CRDs spell them."""

from __future__ import annotations

from typing import Any

GROUP = "ladle.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
ISVC_KIND = "InferenceService"
ISVC_PLURAL = "inferenceservices"
POOL_KIND = "GPUPool"
POOL_PLURAL = "gpupools"
# The Gateway API Inference Extension's pool, which the operator creates where its CRDs are.
INFERENCE_POOL_API_VERSION = "inference.networking.k8s.io/v1"
INFERENCE_POOL_KIND = "InferencePool"
INFERENCE_POOL_PLURAL = "inferencepools"
# The Gateway API's route, which sends a service's model from a Gateway to its pool.
HTTP_ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
HTTP_ROUTE_KIND = "HTTPRoute"
HTTP_ROUTE_PLURAL = "httproutes"
# GAIE's rewrite of a request's model within a pool, which takes a service's model to the
# fallback's when the route falls back.
MODEL_REWRITE_API_VERSION = "inference.networking.x-k8s.io/v1alpha2"
MODEL_REWRITE_KIND = "InferenceModelRewrite"
MODEL_REWRITE_PLURAL = "inferencemodelrewrites"

# Labels on every child; the first two are also the Deployment/Service selectors.
LABEL_ISVC = "ladle.dev/inferenceservice"
LABEL_VARIANT = "ladle.dev/variant"
# A replica that spans nodes (spec.parallelism.nodes) is a group: its leader is a pod of the
# variant's Deployment, carrying the labels above; its workers carry LABEL_WORKER_OF instead of
# LABEL_ISVC (no Service, gateway or scale selector picks them), and the name of their leader.
# LABEL_GROUP is on both: the variant's headless Service selects them by it.
LABEL_WORKER_OF = "ladle.dev/worker-of"
LABEL_LEADER = "ladle.dev/leader"
LABEL_GROUP = "ladle.dev/group"
# On runtime pods whose engine settings are in a ConfigMap: its digest, so that an edit rolls
# them (and tells which settings a pod runs).
CONFIG_HASH_ANNOTATION = "ladle.dev/config-hash"
# On a leader pod: the digest of the pod template it runs, from which its workers are made.
GROUP_TEMPLATE_ANNOTATION = "ladle.dev/group-template"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "ladle-operator"
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
# On runtime pods: the GPUPool whose quota they count against, so that pods still draining
# after their InferenceService is gone keep counting.
LABEL_POOL = "ladle.dev/gpupool"
# Keeps a GPUPool that InferenceServices still use from being deleted under them.
POOL_FINALIZER = "ladle.dev/in-use"

# The node label NVIDIA GPU feature discovery sets; GPUPool.spec.product selects on it.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"

# The variants of an InferenceService: the revision that serves, and the one on trial.
STABLE = "stable"
CANARY = "canary"
# The response header naming the service that answered for another one: its fallback
# (Ladle's gateway sets it, and so does the HTTPRoute a GAIE gateway follows).
FALLBACK_HEADER = "x-ladle-fallback"
# One-shot rollout commands (promote, abort, retry): the operator acts, then removes it.
ROLLOUT_ACTION_ANNOTATION = "ladle.dev/rollout-action"
ROLLOUT_ACTIONS = ("promote", "abort", "retry")
# "enabled": the runtime pods run with --profile-dir on a bounded emptyDir (docs/pipeline.md).
PROFILING_ANNOTATION = "ladle.dev/profiling"

JSON = dict[str, Any]
