"""Pod picking (least outstanding + CHWBL) and the canary split, as pure functions."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ladle.gateway.picker import Candidate, HashRing, bounded_capacity, pick
from ladle.gateway.split import choose_variant


def pods(loads: dict[str, int]) -> list[Candidate]:
    return [Candidate(name, n) for name, n in loads.items()]


def test_without_a_prefix_the_least_loaded_pod_wins() -> None:
    rng = random.Random(0)
    chosen = pick(pods({"a": 3, "b": 1, "c": 2}), rng=rng)
    assert chosen is not None
    assert chosen.name == "b"


def test_scraped_queue_and_kv_break_ties_and_saturated_pods_are_avoided() -> None:
    rng = random.Random(0)
    tie = [Candidate("a", 1, waiting=4), Candidate("b", 1, waiting=0, kv_usage=0.9)]
    assert pick(tie, rng=rng).name == "b"  # type: ignore[union-attr]
    busy = [Candidate("a", 0, kv_usage=0.99), Candidate("b", 5, kv_usage=0.2)]
    assert pick(busy, rng=rng).name == "b"  # type: ignore[union-attr]
    everyone_busy = [Candidate("a", 0, kv_usage=0.99), Candidate("b", 5, kv_usage=0.99)]
    assert pick(everyone_busy, rng=rng).name == "a"  # type: ignore[union-attr]


def test_no_candidates_no_pick() -> None:
    assert pick([], rng=random.Random(0)) is None


def test_same_prefix_same_pod_while_load_allows() -> None:
    names = [f"pod-{i}" for i in range(4)]
    ring = HashRing(names)
    rng = random.Random(0)
    key = b"You are a helpful assistant. Answer briefly."
    first = pick(pods(dict.fromkeys(names, 0)), rng=rng, key=key, ring=ring)
    assert first is not None
    for _ in range(20):
        again = pick(pods(dict.fromkeys(names, 1)), rng=rng, key=key, ring=ring)
        assert again is not None
        assert again.name == first.name


def test_different_prefixes_spread_over_pods() -> None:
    names = [f"pod-{i}" for i in range(4)]
    ring = HashRing(names)
    rng = random.Random(0)
    counts = collections.Counter(
        pick(pods(dict.fromkeys(names, 0)), rng=rng, key=f"user {i}".encode(), ring=ring).name  # type: ignore[union-attr]
        for i in range(2000)
    )
    assert set(counts) == set(names)
    assert min(counts.values()) > 2000 / 4 * 0.5


def test_an_overloaded_owner_spills_to_the_next_pod_on_the_ring() -> None:
    names = ["a", "b", "c"]
    ring = HashRing(names)
    key = b"shared system prompt"
    owner, nxt = ring.walk(key)[:2]
    loads = {"a": 0, "b": 0, "c": 0}
    loads[owner] = 10  # far above 1.25 x the mean
    chosen = pick(pods(loads), rng=random.Random(0), key=key, ring=ring, load_factor=1.25)
    assert chosen is not None
    assert chosen.name == nxt


def test_ring_is_stable_across_processes_and_minimal_on_change() -> None:
    """The hash is not Python's salted hash(), so two gateway replicas agree; removing a pod
    moves only the keys it owned."""
    before = HashRing(["a", "b", "c", "d"])
    after = HashRing(["a", "b", "c"])
    keys = [f"k{i}".encode() for i in range(1000)]
    moved = [k for k in keys if before.walk(k)[0] != after.walk(k)[0]]
    assert all(before.walk(k)[0] == "d" for k in moved)
    assert HashRing(["a", "b", "c", "d"]).walk(b"k1") == before.walk(b"k1")


@pytest.mark.parametrize(
    ("total", "n", "c", "cap"), [(0, 2, 1.25, 1), (7, 2, 1.25, 5), (99, 4, 1.25, 32)]
)
def test_bounded_capacity(total: int, n: int, c: float, cap: int) -> None:
    assert bounded_capacity(total, n, c) == cap


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 20), min_size=2, max_size=8),
    st.binary(min_size=1, max_size=40),
)
def test_chwbl_never_exceeds_the_bound_while_a_pod_is_within_it(
    loads: list[int], key: bytes
) -> None:
    names = [f"p{i}" for i in range(len(loads))]
    cands = [Candidate(n, load) for n, load in zip(names, loads, strict=True)]
    chosen = pick(cands, rng=random.Random(0), key=key, ring=HashRing(names), load_factor=1.25)
    assert chosen is not None
    cap = bounded_capacity(sum(loads), len(loads), 1.25)
    if any(load + 1 <= cap for load in loads):
        assert chosen.outstanding + 1 <= cap
    else:
        assert chosen.outstanding == min(loads)


# -- the canary split ------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=4).filter(lambda w: sum(w) > 0))
def test_weights_are_respected_within_tolerance(weights: list[int]) -> None:
    variants = [(f"v{i}", w) for i, w in enumerate(weights)]
    rng = random.Random(1)
    draws = 20_000
    counts = collections.Counter(
        choose_variant(variants, {v for v, _ in variants}, rng=rng) for _ in range(draws)
    )
    total = sum(weights)
    for name, w in variants:
        share = counts[name] / draws
        assert abs(share - w / total) < 0.02, (name, share, w / total)
        if w == 0:
            assert counts[name] == 0


def test_sticky_sessions_stay_on_one_variant_and_still_split_by_weight() -> None:
    variants = [("stable", 90), ("canary", 10)]
    rng = random.Random(0)
    for i in range(50):
        key = f"session-{i}".encode()
        first = choose_variant(variants, {"stable", "canary"}, rng=rng, sticky=key)
        assert all(
            choose_variant(variants, {"stable", "canary"}, rng=rng, sticky=key) == first
            for _ in range(10)
        )
    counts = collections.Counter(
        choose_variant(variants, {"stable", "canary"}, rng=rng, sticky=f"s{i}".encode())
        for i in range(20_000)
    )
    assert abs(counts["canary"] / 20_000 - 0.10) < 0.02


def test_a_variant_without_pods_gives_its_share_away_but_weight_zero_gets_nothing() -> None:
    rng = random.Random(0)
    variants = [("stable", 0), ("canary", 100)]
    assert choose_variant(variants, {"stable"}, rng=rng) is None
    assert choose_variant([("stable", 50), ("canary", 50)], {"stable"}, rng=rng) == "stable"
