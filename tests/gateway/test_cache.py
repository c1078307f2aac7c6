"""The response cache's decisions, pure: what is cacheable, what the key separates, the bound."""

from __future__ import annotations

import pytest

from ladle.gateway.apikeys import KeyFileError, parse_keys
from ladle.gateway.cache import Entry, ResponseCache, cache_key, cacheable
from ladle.gateway.routes import parse_service
from ladle.operator.revisions import revision_of, template_of

DOC = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0}


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0, "top_p": 0.5}, True),
        ({"temperature": 0.7, "seed": 3}, True),
        ({"seed": 0}, True),
        ({}, False),  # OpenAI's default temperature is 1: sampled
        ({"temperature": 0.7}, False),
        ({"temperature": 1, "seed": None}, False),
        ({"temperature": 1, "seed": True}, False),
        ({"temperature": "0"}, False),
    ],
)
def test_only_greedy_or_seeded_requests_are_cacheable(
    doc: dict[str, object], expected: bool
) -> None:
    assert cacheable(doc) is expected


def key(**changes: object) -> bytes:
    args: dict[str, object] = {
        "service": ("ns", "chat"),
        "revision": "r1",
        "variant": "stable",
        "scope": "team-a",
        "path": b"/v1/chat/completions",
        "doc": DOC,
    }
    args.update(changes)
    return cache_key(**args)  # type: ignore[arg-type]


def test_the_key_separates_everything_an_answer_depends_on() -> None:
    base = key()
    assert key() == base
    assert key(doc={**DOC, "user": "someone", "metadata": {"a": 1}}) == base
    assert key(doc=dict(reversed(list(DOC.items())))) == base
    different = [
        key(service=("ns", "other")),
        key(revision="r2"),
        key(variant="canary"),
        key(scope="team-b"),
        key(path=b"/v1/completions"),
        key(doc={**DOC, "max_tokens": 5}),
        key(doc={**DOC, "stream": True}),
        key(doc={**DOC, "messages": [{"role": "user", "content": "Hi!"}]}),
    ]
    assert len({base, *different}) == len(different) + 1


def isvc(spec: dict[str, object], variants: list[dict[str, object]]) -> dict[str, object]:
    return {
        "metadata": {"name": "s"},
        "spec": {"model": {"name": "m"}, "responseCache": {"enabled": True}, **spec},
        "status": {"variants": variants},
    }


def test_answers_are_keyed_on_the_revision_the_pods_run_not_on_the_spec() -> None:
    spec = {"model": {"name": "m"}}
    old, new = (revision_of(template_of(spec, image)) for image in ("runtime:1", "runtime:2"))
    assert old != new  # a new runtime image alone is a new revision
    stable = {"name": "stable", "revision": old, "replicas": 2, "updatedReplicas": 2}
    # An int8 canary is asked for, and the stable pods still run the old revision: their
    # answers are the old revision's (a key from the spec would file them under the new one).
    service = parse_service(isvc({"quantization": {"weights": "int8"}}, [stable]))
    assert service.response_cache
    assert service.revision("stable") == old
    assert parse_service(isvc({"replicas": 5}, [stable])).revision("stable") == old
    # Pods of two revisions answer while a variant's pods are replaced; before the operator
    # reports, nothing is known. Either way there is no key, so nothing is cached.
    rolling = {**stable, "revision": new, "updatedReplicas": 1}
    assert parse_service(isvc({}, [rolling])).revision("stable") is None
    assert parse_service(isvc({}, [])).revision("stable") is None


def test_the_cache_is_bounded_and_least_recently_used_goes_first() -> None:
    cache = ResponseCache(8000)
    entry = Entry(200, ((b"content-type", b"application/json"),), b"x" * 900, False)
    for i in range(10):
        assert cache.put(bytes([i]), entry)
        if i == 5:
            assert cache.get(bytes([0])) is entry  # touched: kept over 1
    assert cache.bytes <= 8000
    assert cache.get(bytes([0])) is entry
    assert cache.get(bytes([1])) is None
    assert cache.evictions == 10 - len(cache)
    assert not cache.put(b"big", Entry(200, (), b"x" * 1001, False))  # over an eighth


def test_keys_share_cached_answers_only_within_a_cache_scope() -> None:
    specs = parse_keys(
        "keys:\n- {name: a1, key: sk-aaaaaaaa, cacheScope: team-a}\n"
        "- {name: a2, key: sk-bbbbbbbb, cacheScope: team-a}\n- {name: b, key: sk-cccccccc}\n"
    )
    assert [s.cache_scope for s in specs] == ["team-a", "team-a", "b"]
    with pytest.raises(KeyFileError, match="cacheScope must be a name"):
        parse_keys("keys:\n- {name: a, key: sk-aaaaaaaa, cacheScope: 'a b'}\n")
