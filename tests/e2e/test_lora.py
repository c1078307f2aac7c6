"""LoRA adapters on real runtime pods, through the chart's gateway: an InferenceService whose
model and adapters live on one claim serves both adapters; an edit that adds a third and drops
one reaches the running pod with no restart (the kubelet refreshes the adapters' ConfigMap the
pod follows), and the dropped one is a 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from lora_adapters import random_adapter

from ladle_dev.pytest_plugin import wait_until

from .conftest import cpu_service
from .test_local_system import link_tree

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

System = Any
NAME, MODEL = "lora", "smollm2-lora"
PROMPT = "Write one word about the sea:"


def adapters_on(names: list[str]) -> list[dict[str, Any]]:
    return [
        {"name": n, "source": {"pvc": {"claimName": "lora-models", "path": f"loras/{n}"}}}
        for n in names
    ]


@pytest.fixture(scope="module")
def volume(
    ladle_system: System, default_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[dict[str, Any]]]:
    """A hostPath volume holding the default model and three random adapters made for it,
    and its claim."""
    folder = tmp_path_factory.mktemp("lora-volume")
    link_tree(default_model, folder / "base")
    for seed, name in enumerate(("sql", "poem", "fr")):
        random_adapter(folder / "base", folder / "loras" / name, seed=seed, rank=8,
                       targets=("q_proj", "v_proj"))  # fmt: skip
    for path in (folder, *folder.rglob("*")):
        path.chmod(0o755 if path.is_dir() else 0o644)  # the runtime runs as 10001
    pv_name = f"{ladle_system.namespace}-lora"
    documents = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "hostPath": {"path": str(folder)},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "lora-models"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    ]
    yield documents
    ladle_system.kubectl("delete", "pv", pv_name, "--wait=false")


def service(adapters: list[str]) -> dict[str, Any]:
    obj = cpu_service(
        NAME,
        MODEL,
        adapters=adapters_on(adapters),
        engine={"maxLoras": 2, "kvCacheMemory": "256Mi", "maxModelLen": 512},
    )
    obj["spec"]["model"]["source"] = {"pvc": {"claimName": "lora-models", "path": "base"}}
    return obj


def answer(llm: openai.OpenAI, model: str) -> str:
    out = llm.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    return out.choices[0].text


def test_adapters_follow_the_spec_on_a_running_pod_through_the_gateway(
    ladle_system: System, volume: list[dict[str, Any]], gateway_url: str
) -> None:
    system = ladle_system
    system.apply([*volume, service(["sql", "poem"])])
    pod = system.ready_pod(NAME)
    llm = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=120)
    # The gateway learns the adapters' names from the InferenceService.
    wait_until(lambda: {"sql", "poem"} <= {m.id for m in llm.models.list()}, "adapters routed", 60)
    base, sql, poem = (answer(llm, m) for m in (MODEL, "sql", "poem"))
    assert len({base, sql, poem}) == 3, (base, sql, poem)

    system.apply([service(["poem", "fr"])])

    def followed() -> bool:
        try:
            answer(llm, "fr")
        except openai.NotFoundError:
            return False
        return True

    # The kubelet refreshes a mounted ConfigMap on its sync (a minute by default).
    wait_until(followed, "the pod to serve the added adapter", 180, interval=2)
    with pytest.raises(openai.NotFoundError):
        answer(llm, "sql")
    assert answer(llm, "poem") == poem
    assert answer(llm, "fr") not in (base, poem)
    after = system.ready_pod(NAME)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    (status,) = after["status"]["containerStatuses"]
    assert status["restartCount"] == 0
