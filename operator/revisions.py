"""What the runtime pods run, as a value: the template of a revision, and its name.

A change to what the pods run (the model's weights, their quantization, engine settings, the
runtime image) is a new **revision**; with ``spec.rollout`` set, it reaches users through a
canary. Everything else applies to every variant at once: replica bounds, routing, the circuit
breaker, the served model name (clients address the service by it, so both variants must
answer to the same one), the API key Secret (a client holding one key must be served by
either variant) and resources (a GPUPool quota counts one size of replica).

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
from dataclasses import asdict, replace
from typing import Any

from ladle.api import JSON, InferenceService, parse_quantization, parse_spec

# spec fields (top level) that a revision consists of; model.source is the other part.
TEMPLATE_FIELDS = ("quantization", "runtime", "engine")
# Engine fields added after revision names were first published: left out of the digest while
# unset, so that an operator upgrade does not rename (and roll out) every running revision.
ADDED_LATER = frozenset({"max_loras", "max_lora_rank", "max_cpu_loras"})


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
    text = json.dumps(parsed, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def with_template(isvc: InferenceService, template: JSON) -> InferenceService:
    """The InferenceService as it would be with ``template``'s revision."""
    raw = apply_template(isvc.raw_spec, template)
    return replace(isvc, spec=parse_spec(raw), raw_spec=raw)


def weights_of(template: JSON) -> str:
    """The weight format a template quantizes to (none, int8, int4)."""
    return parse_quantization(template.get("quantization")).weights
