"""Filters named on the command line: a built-in or installed entry point (group
``ladle.runtime.filters``), or an import path ``package.module:Name``."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from ladle.runtime.config import ConfigError
from ladle.runtime.filters import InputFilter, OutputFilter

GROUP = "ladle.runtime.filters"
BUILT_IN = {"pii": "ladle.runtime.filters.pii:PIIFilter"}


def _resolve(spec: str) -> Any:
    path = BUILT_IN.get(spec)
    if path is None and ":" not in spec:
        found = [ep for ep in entry_points(group=GROUP) if ep.name == spec]
        if not found:
            known = sorted({*BUILT_IN, *(ep.name for ep in entry_points(group=GROUP))})
            raise ConfigError(
                f"filter {spec!r}: no such filter (known: {', '.join(known)}; or give an "
                "import path, package.module:Name)"
            )
        return found[0].load()
    module_name, _, attr = (path or spec).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"filter {spec!r}: cannot import {module_name}: {exc}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"filter {spec!r}: {module_name} has no {attr!r}") from None


def load(spec: str, role: str) -> Any:
    """The filter named ``spec``, checked to play ``role`` (``input`` or ``output``)."""
    obj = _resolve(spec.strip())
    if isinstance(obj, type) or (callable(obj) and not hasattr(obj, "name")):
        try:
            obj = obj()
        except Exception as exc:
            raise ConfigError(f"filter {spec!r}: could not be created: {exc}") from None
    wanted = InputFilter if role == "input" else OutputFilter
    if not isinstance(obj, wanted):
        needs = "check(request)" if role == "input" else "scan(text, start) and settled(text)"
        raise ConfigError(f"filter {spec!r} cannot be an {role} filter: it needs name and {needs}")
    return obj


def load_input(specs: list[str]) -> list[InputFilter]:
    return [load(spec, "input") for spec in specs]


def load_output(specs: list[str]) -> list[OutputFilter]:
    return [load(spec, "output") for spec in specs]
