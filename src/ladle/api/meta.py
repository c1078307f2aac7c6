"""What every object has (its metadata), label selectors, and the small readers that map the
API's optional JSON fields onto typed values."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class ObjectMeta:
    namespace: str
    name: str
    uid: str
    generation: int
    created: str
    deleting: bool
    finalizers: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Requirement:
    """One ``matchExpressions`` entry of a metav1.LabelSelector."""

    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        inside = labels.get(self.key) in self.values
        return inside if self.operator == "In" else not inside


@dataclass(frozen=True)
class LabelSelector:
    """metav1.LabelSelector: every label and every expression must match (empty: everything)."""

    match_labels: Mapping[str, str]
    expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            r.matches(labels) for r in self.expressions
        )

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in sorted(self.match_labels.items())]
        for r in self.expressions:
            if r.operator == "Exists":
                parts.append(r.key)
            elif r.operator == "DoesNotExist":
                parts.append(f"!{r.key}")
            else:
                word = "in" if r.operator == "In" else "notin"
                parts.append(f"{r.key} {word} ({','.join(sorted(r.values))})")
        return ",".join(parts) or "(everything)"


def parse_meta(obj: Mapping[str, Any]) -> ObjectMeta:
    meta = obj.get("metadata") or {}
    return ObjectMeta(
        namespace=str(meta.get("namespace") or ""),
        name=str(meta["name"]),
        uid=str(meta.get("uid") or ""),
        generation=int(meta.get("generation") or 0),
        created=str(meta.get("creationTimestamp") or ""),
        deleting=bool(meta.get("deletionTimestamp")),
        finalizers=tuple(str(f) for f in meta.get("finalizers") or ()),
        annotations={str(k): str(v) for k, v in (meta.get("annotations") or {}).items()},
    )


def opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_selector(raw: Mapping[str, Any] | None) -> LabelSelector | None:
    if raw is None:
        return None
    return LabelSelector(
        match_labels={str(k): str(v) for k, v in (raw.get("matchLabels") or {}).items()},
        expressions=tuple(
            Requirement(
                str(e["key"]), e["operator"], frozenset(str(v) for v in e.get("values") or ())
            )
            for e in raw.get("matchExpressions") or ()
        ),
    )
