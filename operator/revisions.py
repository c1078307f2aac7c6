"""What the runtime pods run, as a value: the template of a revision, and its name.

A change to what the pods run (the model's weights, their quantization, engine settings, the
runtime image, the LoRA adapters and their versions) is a new **revision**; with
``spec.rollout`` set, it reaches users through a canary. Two kinds of change are exempt, since
nothing a client is already served changes: adapters added or removed (``in_place``) apply to
every variant at once, and so does everything outside the template: replica bounds, routing,
the circuit breaker, the served model name (clients address the service by it, so both variants
must answer to the same one), the API key Secret (a client holding one key must be served by
either variant) and resources (a GPUPool quota counts one size of replica). A new version of an
adapter (another source under the same name) is a canary of that adapter.

The template is kept as the spec's own JSON (``status.rollout.stableTemplate`` holds the
stable one, so that any leader renders the stable variant as it was), with the runtime image
resolved: a new operator default image is a new revision too. The revision name is a digest
of the *parsed* template, so that representational changes (a default the CRD gained, a field
written differently) are not mistaken for a new revision.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from ladle.api import (
    JSON,
    InferenceService,
    ModelSource,
    parse_quantization,
    parse_source,
    parse_spec,
)

# spec fields (top level) that a revision consists of; model.source is the other part.
TEMPLATE_FIELDS = ("quantization", "runtime", "engine", "adapters")
# Engine fields added after revision names were first published: left out of the digest while
# unset, so that an operator upgrade does not rename (and roll out) every running revision.
ADDED_LATER = frozenset({"max_loras", "max_lora_rank", "max_cpu_loras", "speculative"})


def template_of(raw_spec: JSON, default_image: str) -> JSON:
    """The revision part of a spec, with the runtime image resolved."""
    template: JSON = {
        "source": copy.deepcopy((raw_spec.get("model") or {}).get("source") or {"builtin": {}})
    }
    for name in TEMPLATE_FIELDS:
        if name in raw_spec:
            template[name] = copy.deepcopy(raw_spec[name])
    runtime = dict(template.get("runtime") or {})
    runtime.setdefault("image", default_image)
    template["runtime"] = runtime
    return template


def apply_template(raw_spec: JSON, template: JSON) -> JSON:
    """``raw_spec`` running ``template``'s revision (everything else unchanged)."""
    spec = {k: v for k, v in raw_spec.items() if k not in TEMPLATE_FIELDS}
    spec["model"] = {**(raw_spec.get("model") or {}), "source": template.get("source")}
    for name in TEMPLATE_FIELDS:
        if name in template:
            spec[name] = template[name]
    return spec


def revision_of(template: JSON) -> str:
    """A short, stable name for a template's revision."""
    spec = parse_spec(apply_template({"model": {"name": "-"}}, template))
    parsed: dict[str, Any] = {
        "source": asdict(spec.source),
        "quantization": asdict(spec.quantization),
        "image": spec.runtime_image,
        "startup": spec.startup_timeout_seconds,
        "engine": {
            k: v for k, v in asdict(spec.engine).items() if v is not None or k not in ADDED_LATER
        },
    }
    if spec.adapters is not None:  # left out while unset, as ADDED_LATER's fields are
        parsed["adapters"] = sorted((a.name, asdict(a.source)) for a in spec.adapters)
    text = json.dumps(parsed, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def with_template(isvc: InferenceService, template: JSON) -> InferenceService:
    """The InferenceService as it would be with ``template``'s revision."""
    raw = apply_template(isvc.raw_spec, template)
    return replace(isvc, spec=parse_spec(raw), raw_spec=raw)


def weights_of(template: JSON) -> str:
    """The weight format a template quantizes to (none, int8, int4)."""
    return parse_quantization(template.get("quantization")).weights


def adapter_sources(template: Mapping[str, Any]) -> dict[str, ModelSource]:
    """Each adapter a template serves, by name, with its (parsed) source."""
    return {str(a["name"]): parse_source(a.get("source")) for a in template.get("adapters") or ()}


def changed_adapters(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Adapters both templates serve from different sources: new versions of them."""
    before, after = adapter_sources(old), adapter_sources(new)
    return sorted(name for name in before.keys() & after.keys() if before[name] != after[name])


def _base(template: Mapping[str, Any]) -> str:
    """The revision without the adapters' list (but whether there is one: that is
    ``--enable-lora``, an engine setting)."""
    rest = {k: v for k, v in template.items() if k != "adapters"}
    return revision_of(rest) + ("+lora" if "adapters" in template else "")


def in_place(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``new`` differs from ``old`` only by adapters added or removed: the pods take
    that without a restart (their ConfigMap changes) and no client's answers change, so it
    needs no canary."""
    return _base(old) == _base(new) and not changed_adapters(old, new)


def base_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether what the base model's clients get changes (not only adapters)."""
    return _base(old) != _base(new)


def carry_adapters(stable: JSON, new: Mapping[str, Any]) -> JSON:
    """``stable`` serving the adapters ``new`` adds and no longer those it removes, each
    adapter it keeps at its own version: during a canary both variants answer to the same
    names, and only the versions under test differ."""
    if "adapters" not in stable:
        return stable  # the canary turns LoRA on: stable serves the base model alone
    after = adapter_sources(new)
    kept = [a for a in stable["adapters"] if str(a["name"]) in after]
    names = {str(a["name"]) for a in kept}
    added = [a for a in new.get("adapters") or () if str(a["name"]) not in names]
    return {**stable, "adapters": copy.deepcopy([*kept, *added])}
