"""What a revision is (``operator/revisions.py``): which spec changes need a canary, and which
adapter changes every variant takes at once."""

from __future__ import annotations

from typing import Any

from ladle.operator.revisions import (
    base_changed,
    carry_adapters,
    changed_adapters,
    in_place,
    revision_of,
    template_of,
)


def adapter(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "source": {"pvc": {"claimName": "loras", "path": path}}}


def template(**spec: Any) -> dict[str, Any]:
    return template_of({"model": {"name": "m"}, **spec}, "img:1")


def test_adapters_and_lora_slots_are_part_of_the_revision_and_a_plain_service_keeps_its_name() -> (
    None
):
    plain = template()
    sql = template(adapters=[adapter("sql", "sql/v1")])
    assert revision_of(sql) != revision_of(plain)
    assert revision_of(template(engine={"maxLoras": 4})) != revision_of(plain)
    # Written in another order, or with the source's fields in another order: the same.
    both = [adapter("sql", "sql/v1"), adapter("fr", "fr/v1")]
    assert revision_of(template(adapters=both)) == revision_of(template(adapters=both[::-1]))
    # The names published before adapters existed are pinned by the Argo CD fixtures
    # (tests/operator/test_gitops_health.py): those still match.


def test_adding_or_removing_adapters_is_in_place_and_a_new_version_is_not() -> None:
    v1 = template(adapters=[adapter("sql", "sql/v1")])
    added = template(adapters=[adapter("sql", "sql/v1"), adapter("fr", "fr/v1")])
    assert in_place(v1, added)
    assert in_place(added, v1)
    assert changed_adapters(v1, added) == []
    v2 = template(adapters=[adapter("sql", "sql/v2"), adapter("fr", "fr/v1")])
    assert not in_place(added, v2)
    assert changed_adapters(added, v2) == ["sql"]
    assert not base_changed(added, v2)
    # Turning LoRA on (even with no adapter) is an engine flag, and so is the quantization.
    assert not in_place(template(), template(adapters=[]))
    assert base_changed(template(), template(adapters=[]))
    int8 = template(adapters=[adapter("sql", "sql/v1")], quantization={"weights": "int8"})
    assert not in_place(v1, int8)
    assert base_changed(v1, int8)


def test_stable_takes_the_names_a_canary_adds_or_removes_but_keeps_its_versions() -> None:
    stable = template(adapters=[adapter("sql", "sql/v1"), adapter("old", "old/v1")])
    new = template(adapters=[adapter("sql", "sql/v2"), adapter("fr", "fr/v1")])
    carried = carry_adapters(stable, new)
    assert carried["adapters"] == [adapter("sql", "sql/v1"), adapter("fr", "fr/v1")]
    assert changed_adapters(carried, new) == ["sql"]
    assert in_place(stable, carried)
    # A canary that turns LoRA on: stable serves the base model as it did.
    assert carry_adapters(template(), new) == template()
