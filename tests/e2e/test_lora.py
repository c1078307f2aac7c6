"""LoRA adapters on real runtime pods, through the chart's gateway: an InferenceService whose
model and adapters live on one claim serves both adapters; an edit that adds a third and drops
one reaches the running pod with no restart (the kubelet refreshes the adapters' ConfigMap the
pod follows), and the dropped one is a 404. A new version of an adapter that damages its
output is a canary that the quality gate rolls back before any client reaches it."""

from __future__ import annotations

import re
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
    """Each adapter at ``loras/<name>`` on the claim (``ghost`` has no folder there)."""
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
    # Rank 32, above the engine's maxLoraRank (16): no pod can serve it.
    random_adapter(folder / "base", folder / "loras" / "wide", seed=3, rank=32,
                   targets=("q_proj", "v_proj"))  # fmt: skip
    # sql's weights scaled 200 times: a version whose every answer is noise.
    random_adapter(folder / "base", folder / "loras" / "sql-broken", seed=0, rank=8,
                   alpha=16 * 200, targets=("q_proj", "v_proj"))  # fmt: skip
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


def service(adapters: list[str], name: str = NAME, **spec: Any) -> dict[str, Any]:
    obj = cpu_service(
        name,
        MODEL if name == NAME else f"{name}-model",
        adapters=adapters_on(adapters),
        engine={"maxLoras": 2, "kvCacheMemory": "256Mi", "maxModelLen": 512},
        **spec,
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

    # Two that cannot be served besides: one of too high a rank, one whose folder is missing.
    system.apply([service(["poem", "fr", "wide", "ghost"])])

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

    # Status names each pod's adapters, and the two it cannot serve with the runtime's words;
    # the service is degraded, not down.
    def reported() -> dict[str, Any] | None:
        found = system.isvc(NAME).get("status") or {}
        conditions = {c["type"]: c for c in found.get("conditions") or ()}
        ready = conditions.get("AdaptersReady") or {}
        return found if ready.get("reason") == "AdapterLoadFailed" else None

    found = wait_until(reported, "AdaptersReady to name the adapters that failed", 60)
    conditions = {c["type"]: c for c in found["conditions"]}
    message = conditions["AdaptersReady"]["message"]
    assert re.search("wide on [^;]*exceeds --max-lora-rank", message), message
    assert "ghost on " in message, message
    assert conditions["Degraded"]["status"] == "True"
    assert conditions["Ready"]["status"] == "True"
    (entry,) = found["adapters"]
    assert entry["pod"] == after["metadata"]["name"]
    assert entry["loaded"] == ["fr", "poem"]
    assert sorted(f["name"] for f in entry["failed"]) == ["ghost", "wide"]
    assert answer(llm, MODEL) == base
    system.kubectl("delete", "lisvc", NAME, "-n", system.namespace, "--wait=false")


CANARY = "lora-canary"
# Three prompts of plain prose: the quality gate scores the adapter's reading of them.
PROMPTS = "\n".join(
    [
        "To make bread, mix flour, water, salt and yeast, knead the dough for ten minutes, let "
        "it rise for an hour, shape it, let it rise again, and bake it in a hot oven.",
        "Water boils at one hundred degrees Celsius at sea level, but at lower temperatures on "
        "high mountains, because the air pressure there is lower.",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who went "
        "out every morning before sunrise and came back every evening with his nets full.",
    ]
)


def test_a_new_adapter_version_that_damages_its_output_rolls_back_on_the_quality_gate(
    ladle_system: System, volume: list[dict[str, Any]], gateway_url: str
) -> None:
    system = ladle_system
    prompts = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "lora-prompts"},
        "data": {"prompts.txt": PROMPTS},
    }
    rollout = {
        "steps": [50, 100],
        "intervalSeconds": 10,
        "analysis": {
            "quality": {"prompts": {"configMapName": "lora-prompts", "key": "prompts.txt"}}
        },
    }
    paths = {"sql": "loras/sql", "poem": "loras/poem"}

    def spec() -> dict[str, Any]:
        obj = service([], name=CANARY, rollout=rollout)
        obj["spec"]["adapters"] = [
            {"name": n, "source": {"pvc": {"claimName": "lora-models", "path": p}}}
            for n, p in paths.items()
        ]
        return obj

    system.apply([*volume, prompts, spec()])
    stable = system.ready_pod(CANARY)
    llm = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", timeout=120)
    wait_until(lambda: {"sql", "poem"} <= {m.id for m in llm.models.list()}, "adapters routed", 60)
    sql, poem = answer(llm, "sql"), answer(llm, "poem")

    paths["sql"] = "loras/sql-broken"
    system.apply([spec()])

    def rollout_status() -> dict[str, Any]:
        block: dict[str, Any] = (system.isvc(CANARY).get("status") or {}).get("rollout") or {}
        return block

    def ended() -> dict[str, Any] | None:
        block = rollout_status()
        done = block.get("phase") == "RolledBack" and "canary" not in block.get("revisions", {})
        return block if done else None

    block = wait_until(ended, "the adapter's canary to roll back", 300, interval=2)
    assert block["reason"] == "QualityGateFailed"
    # Only the adapter that changed was compared, under the adapter gate (perplexity).
    assert block["quality"]["message"].startswith("adapter sql: perplexity +"), block["quality"]
    assert block["quality"]["perplexityIncrease"] > 0.1
    # Stable still serves the old version, in the same pod; the canary's pods are gone.
    assert (answer(llm, "sql"), answer(llm, "poem")) == (sql, poem)
    assert system.ready_pod(CANARY)["metadata"]["uid"] == stable["metadata"]["uid"]
    wait_until(
        lambda: all(p["metadata"]["labels"].get("ladle.dev/variant") != "canary"
                    for p in system.pods(CANARY)),
        "the canary's pods to go", 120,
    )  # fmt: skip
