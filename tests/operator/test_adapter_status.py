"""What status says of the adapters each pod serves (``operator/adapter_status.py``), from the
pods' answers: loading, loaded, and an adapter a pod cannot serve, named with its reason."""

from __future__ import annotations

from ladle.operator.adapter_status import (
    CATCHING_UP_SECONDS,
    SETTLED_SECONDS,
    PodAdapters,
    observe,
    parse_report,
)

WANTED = {"stable": ["sql", "fr"]}


def test_a_pods_answer_is_parsed_and_an_answer_of_another_shape_is_an_error() -> None:
    body = {
        "loaded": [{"name": "sql", "path": "/m/sql"}, {"name": "fr", "path": "/m/fr"}],
        "failed": [{"name": "wide", "path": "/m/wide", "error": "rank 64 exceeds 16"}],
    }
    pod = parse_report("p-1", "stable", body)
    assert pod == PodAdapters("p-1", "stable", ("fr", "sql"), {"wide": "rank 64 exceeds 16"})
    bad = parse_report("p-1", "stable", ["not", "an", "object"])
    assert bad.error is not None
    assert bad.error.startswith("unreadable answer")


def test_every_pod_serving_every_adapter_is_loaded_and_asked_again_rarely() -> None:
    seen = observe(WANTED, [PodAdapters("a", "stable", ("fr", "sql"))] * 2)
    assert (seen.condition.status, seen.condition.reason) == (True, "Loaded")
    assert seen.condition.message == "every ready pod serves its 2 adapters"
    assert seen.recheck_in == SETTLED_SECONDS
    assert seen.status() == [{"pod": "a", "variant": "stable", "loaded": ["fr", "sql"]}] * 2


def test_a_pod_that_has_not_caught_up_is_loading_and_asked_again_soon() -> None:
    pods = [PodAdapters("a", "stable", ("fr", "sql")), PodAdapters("b", "stable", ("sql",))]
    seen = observe(WANTED, pods)
    assert (seen.condition.status, seen.condition.reason) == (False, "Loading")
    assert seen.condition.message == "fr: loading on 1 pod"
    assert seen.recheck_in == CATCHING_UP_SECONDS


def test_an_adapter_a_pod_cannot_serve_is_named_with_the_runtimes_reason() -> None:
    pods = [
        PodAdapters("a", "stable", ("sql",), {"fr": "rank 64 exceeds --max-lora-rank 16"}),
        PodAdapters("b", "stable", ("sql",), {"fr": "rank 64 exceeds --max-lora-rank 16"}),
        PodAdapters("c", "stable", error="timed out"),
    ]
    seen = observe(WANTED, pods)
    assert (seen.condition.status, seen.condition.reason) == (False, "AdapterLoadFailed")
    assert seen.condition.message == "fr on a: rank 64 exceeds --max-lora-rank 16"
    assert seen.status()[0]["failed"] == [
        {"name": "fr", "message": "rank 64 exceeds --max-lora-rank 16"}
    ]
    assert seen.status()[2] == {"pod": "c", "variant": "stable", "loaded": [], "error": "timed out"}


def test_pods_that_do_not_answer_say_nothing_either_way() -> None:
    silent = observe(WANTED, [PodAdapters("a", "stable", error="connection refused")])
    assert (silent.condition.status, silent.condition.reason) == (True, "NoPodAnswered")
    assert silent.recheck_in == CATCHING_UP_SECONDS
    assert observe(WANTED, []).condition.message == "no ready pod to ask"
    # Each variant is held to its own list: a canary turning LoRA on, beside a stable without.
    both = observe(
        {"canary": ["sql"]},
        [PodAdapters("s", "stable"), PodAdapters("c", "canary", ("sql",))],
    )
    assert both.condition.reason == "Loaded"
