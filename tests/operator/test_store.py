"""The store's own rules: indexes follow every change, and a re-list evicts only what vanished
before it began."""

from __future__ import annotations

from ladle.operator.applier import metadata_drift
from ladle.operator.store import Store


def test_indexes_follow_upserts_and_deletes() -> None:
    store = Store()
    store.add_indexer("Pod", "owner", lambda p: [p["owner"]])
    store.upsert("Pod", ("a", "p1"), {"owner": "x"})
    store.upsert("Pod", ("a", "p2"), {"owner": "x"})
    assert store.index_keys("Pod", "owner", "x") == [("a", "p1"), ("a", "p2")]
    store.upsert("Pod", ("a", "p1"), {"owner": "y"})  # moved
    assert store.index_keys("Pod", "owner", "x") == [("a", "p2")]
    store.delete("Pod", ("a", "p2"))
    assert store.by_index("Pod", "owner", "x") == []
    assert store.by_index("Pod", "owner", "y") == [{"owner": "y"}]


def test_a_relist_evicts_only_what_no_event_touched_since_it_began() -> None:
    store = Store()
    for name in ("kept", "vanished", "recreated"):
        store.upsert("Service", ("a", name), {"name": name})
    listed_from = store.sequence  # the list request leaves now
    store.upsert("Service", ("a", "recreated"), {"name": "recreated"})  # a watch event since
    store.upsert("Service", ("a", "new"), {"name": "new"})
    stale = store.stale("Service", [("a", "kept")], listed_from)
    assert stale == [("a", "vanished")]


def test_metadata_drift_names_what_someone_else_changed() -> None:
    desired = {
        "metadata": {
            "labels": {"app": "x", "managed": "ladle"},
            "annotations": {"hash": "1"},
            "ownerReferences": [{"uid": "u"}],
        }
    }
    assert metadata_drift(desired, desired) == []
    live = {
        "metadata": {
            "labels": {"app": "x", "extra": "theirs"},  # an added label is not drift
            "annotations": {"hash": "2"},
            "ownerReferences": [],
        }
    }
    assert metadata_drift(desired, live) == ["label managed", "annotation hash", "owner reference"]
