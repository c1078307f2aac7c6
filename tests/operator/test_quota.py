"""GPUPool quota plans: fairness, what pods really hold, and surge, as pure functions."""

from ladle.operator.quota import Claim, plan_pool


def claim(
    key: str,
    created: str,
    requested: int,
    gpus: int = 1,
    current: int = 0,
    *,
    minimum: int = 1,
    held: int | None = None,
    surge: bool = False,
) -> Claim[str]:
    return Claim(
        key,
        created,
        requested,
        gpus,
        current,
        min_replicas=minimum,
        held_gpus=current * gpus if held is None else held,
        wants_surge=surge,
    )


def test_no_quota_grants_everything() -> None:
    plan = plan_pool(None, [claim("a", "1", 3, 2), claim("b", "2", 5, 1)])
    assert plan.granted == {"a": 3, "b": 5}
    assert (plan.claimed_gpus, plan.requested_gpus, plan.quota_gpus) == (11, 11, None)


def test_first_come_first_served_beyond_the_guarantees() -> None:
    plan = plan_pool(4, [claim("young", "2026-02", 3), claim("old", "2026-01", 3)])
    # Each is guaranteed one replica (minReplicas 1); the rest goes to the oldest.
    assert plan.granted == {"old": 3, "young": 1}
    assert (plan.claimed_gpus, plan.requested_gpus) == (4, 6)


def test_scaling_up_an_old_service_never_evicts_a_younger_ones_replicas() -> None:
    # "young" runs 2 replicas; "old" (created first) asks for 2 more than it has.
    plan = plan_pool(
        4, [claim("old", "2026-01", 4, current=2), claim("young", "2026-02", 2, current=2)]
    )
    assert plan.granted == {"old": 2, "young": 2}


def test_freed_quota_goes_to_the_oldest_waiting_service() -> None:
    plan = plan_pool(
        5,
        [
            claim("a", "2026-01", 2, current=2),
            claim("b", "2026-02", 3, current=1),
            claim("c", "2026-03", 2, current=1),
        ],
    )
    assert plan.granted == {"a": 2, "b": 2, "c": 1}


def test_a_newcomer_is_never_starved_by_services_above_their_guarantee() -> None:
    """A full pool: the old service runs all 4 GPUs. The newcomer's guaranteed replica is
    taken from the old service's replicas above its own guarantee, and granted once the
    replica it displaces has drained (the old service's pods still hold 4 GPUs)."""
    old = claim("old", "2026-01", 4, current=4)
    plan = plan_pool(4, [old, claim("new", "2026-02", 1)])
    assert plan.granted == {"old": 3, "new": 0}  # the 4th replica must drain first
    assert plan.guaranteed == {"old": 1, "new": 1}
    assert plan.claimed_gpus == 4  # never more than the quota, even meanwhile
    drained = claim("old", "2026-01", 4, current=3)
    assert plan_pool(4, [drained, claim("new", "2026-02", 1)]).granted == {"old": 3, "new": 1}


def test_the_guarantee_is_capped_at_a_fair_share_so_it_cannot_be_gamed() -> None:
    # "greedy" asks to be guaranteed 8 of 8 GPUs; three services share them.
    plan = plan_pool(
        8,
        [
            claim("greedy", "2026-01", 8, current=8, minimum=8),
            claim("b", "2026-02", 2, minimum=2),
            claim("c", "2026-03", 2, minimum=2),
        ],
    )
    assert plan.guaranteed == {"greedy": 2, "b": 2, "c": 2}
    assert plan.granted["greedy"] == 4  # cut at once; b and c grow as its pods drain


def test_terminating_pods_keep_counting_until_they_are_gone() -> None:
    # A deleted service's pods still drain, holding 2 GPUs: nobody else may have them yet.
    waiting = claim("b", "2026-02", 2)
    assert plan_pool(2, [waiting], orphan_gpus=2).granted == {"b": 0}
    assert plan_pool(2, [waiting], orphan_gpus=1).granted == {"b": 1}
    assert plan_pool(2, [waiting], orphan_gpus=0).granted == {"b": 2}
    # A service that scaled down: its draining replica still counts.
    plan = plan_pool(2, [claim("a", "2026-01", 1, current=1, held=2), waiting])
    assert plan.granted == {"a": 1, "b": 0}
    assert plan.held_gpus == 2


def test_a_shrinking_quota_takes_from_the_newest_first() -> None:
    plan = plan_pool(3, [claim("a", "2026-01", 2, current=2), claim("b", "2026-02", 2, current=2)])
    assert plan.granted == {"a": 2, "b": 1}


def test_replicas_never_split_a_gpu_set() -> None:
    # Two 4-GPU replicas do not fit into 6 GPUs; the leftover 2 GPUs fit the 2-GPU service.
    plan = plan_pool(6, [claim("big", "2026-01", 2, gpus=4), claim("small", "2026-02", 1, gpus=2)])
    assert plan.granted == {"big": 1, "small": 1}
    assert plan.claimed_gpus == 6


def test_cpu_only_services_do_not_count_against_the_quota() -> None:
    plan = plan_pool(0, [claim("cpu", "2026-01", 3, gpus=0), claim("gpu", "2026-02", 1)])
    assert plan.granted == {"cpu": 3, "gpu": 0}


def test_ties_on_creation_time_break_on_the_key_deterministically() -> None:
    claims = [claim("b", "2026-01", 1), claim("a", "2026-01", 1)]
    assert plan_pool(1, claims).granted == {"a": 1, "b": 0}
    assert plan_pool(1, list(reversed(claims))).granted == {"a": 1, "b": 0}


def test_a_rollout_surges_only_into_headroom() -> None:
    rolling = claim("a", "2026-01", 2, current=2, surge=True)
    # Quota equals what the service runs: no spare replica, so it replaces in place.
    assert plan_pool(2, [rolling]).surge == frozenset()
    roomy = plan_pool(3, [rolling])
    assert roomy.surge == {"a"}
    assert roomy.claimed_gpus == 3  # the surge replica is counted
    # Without a quota, the pool's free GPUs decide; one slot goes to the oldest.
    both = [rolling, claim("b", "2026-02", 1, current=1, surge=True)]
    assert plan_pool(None, both, free_gpus=1).surge == {"a"}
    assert plan_pool(None, both, free_gpus=2).surge == {"a", "b"}
    assert plan_pool(None, both, free_gpus=0).surge == frozenset()


def test_a_surge_never_takes_what_a_waiting_service_is_owed() -> None:
    plan = plan_pool(3, [claim("a", "2026-01", 2, current=2, surge=True), claim("b", "2026-02", 1)])
    assert plan.granted == {"a": 2, "b": 1}
    assert plan.surge == frozenset()
