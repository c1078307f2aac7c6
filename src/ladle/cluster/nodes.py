"""Fake GPU nodes: Node objects that kwok keeps alive, labelled like GPU Feature Discovery would.

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


def gpu_node(
    index: int,
    *,
    gpus: int = 8,
    product: str = "NVIDIA-H200",
    gpu_memory_mib: int = 143771,
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
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": product,
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": str(gpu_memory_mib),
            },
        },
        "spec": {},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }
