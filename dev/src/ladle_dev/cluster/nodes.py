"""GPU nodes for the local cluster: kwok's fake ones, and the labels the local nodes (real
kubelets) share with them.

The labels match what NVIDIA's GPU Feature Discovery puts on real nodes, so a GPU pool's node
selector written for production selects these nodes unchanged.
"""

from __future__ import annotations

from typing import Any

# kwok manages exactly the nodes with this annotation (``--manage-nodes-with-annotation-selector``).
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_SELECTOR = f"{KWOK_ANNOTATION}=fake"
GPU_RESOURCE = "nvidia.com/gpu"
NODE_PREFIX = "ladle-gpu-"
LOCAL_NODE_PREFIX = "ladle-local-"
# Local nodes (real kubelets) carry this label; beside kwok nodes they also carry a NoSchedule
# taint of the same key, so that only pods that ask to really run get them.
LOCAL_NODE_LABEL = "ladle.dev/local-node"
H200_MEMORY_MIB = 143771


def gfd_labels(product: str, gpus: int, gpu_memory_mib: int = H200_MEMORY_MIB) -> dict[str, str]:
    """What NVIDIA GPU Feature Discovery labels a node with."""
    return {
        "nvidia.com/gpu.present": "true",
        "nvidia.com/gpu.product": product,
        "nvidia.com/gpu.count": str(gpus),
        "nvidia.com/gpu.memory": str(gpu_memory_mib),
    }


def gpu_node(
    index: int,
    *,
    gpus: int = 8,
    product: str = "NVIDIA-H200",
    gpu_memory_mib: int = H200_MEMORY_MIB,
) -> dict[str, Any]:
    """A Node manifest whose status already carries ``nvidia.com/gpu`` capacity.

    Node creation keeps ``status``, and kwok's node-initialize stage preserves capacity and
    allocatable that are already set, so the scheduler sees the GPUs from the first moment.
    """
    name = f"{NODE_PREFIX}{index}"
    resources = {
        "cpu": "128",
        "memory": "2Ti",
        "pods": "110",
        "ephemeral-storage": "10Ti",
        GPU_RESOURCE: str(gpus),
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                **gfd_labels(product, gpus, gpu_memory_mib),
            },
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


def local_labels(product: str, gpus: int) -> dict[str, str]:
    """What a local node's kubelet registers with (``--node-labels``)."""
    return {"type": "local", LOCAL_NODE_LABEL: "true", **gfd_labels(product, gpus)}
