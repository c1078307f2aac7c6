from ladle.operator.quota import Claim, plan_pool


def claim(key: str, created: str, requested: int, gpus: int = 1, current: int = 0) -> Claim[str]:
    return Claim(key, created, requested, gpus, current)


def test_no_quota_grants_everything() -> None:
    plan = plan_pool(None, [claim("a", "1", 3, 2), claim("b", "2", 5, 1)])
    assert plan.granted == {"a": 3, "b": 5}
    assert (plan.claimed_gpus, plan.requested_gpus, plan.quota_gpus) == (11, 11, None)


def test_first_come_first_served_by_creation_time() -> None:
    plan = plan_pool(4, [claim("young", "2026-02", 3), claim("old", "2026-01", 3)])
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
        4,
        [
            claim("a", "2026-01", 2, current=2),
            claim("b", "2026-02", 3, current=1),
            claim("c", "2026-03", 2, current=0),
        ],
    )
    assert plan.granted == {"a": 2, "b": 2, "c": 0}


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
