"""The value types of every setting: each turns text (a flag, a ``LADLE_*`` variable, a value
in a ``--config`` file) into a value, or raises ``Invalid`` saying what is allowed, so that a
mistake reads the same wherever it was made. ``ladle.settings`` names the setting and where
its value came from. Only the standard library, for ``ladle --help``.
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

_F = TypeVar("_F", bound=Callable[[str], Any])
LOG_LEVELS = ("debug", "info", "warning", "error")
TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
FALSE = frozenset({"0", "false", "no", "off", "n", "f"})


class Invalid(ValueError):
    """Raised by a value type: the message says what is allowed, e.g. "expected a whole
    number >= 1". ``resolve`` prefixes the setting and its source."""


# -- value types: each turns text into a value or raises Invalid with what is allowed --------


def _label(parse: _F, metavar: str, allowed: str) -> _F:
    """What help shows for a value (``N``, ``SIZE``) and what a value of the wrong kind (a YAML
    list, say) is told is allowed; plain attributes, read with getattr."""
    parse.__dict__.update(metavar=metavar, allowed=allowed)
    return parse


def _bound_text(minimum: float | None, maximum: float | None, above: float | None) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above:g}")
    if minimum is not None:
        parts.append(f">= {minimum:g}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}")
    return " and ".join(parts)


def integer(
    minimum: int | None = None,
    maximum: int | None = None,
    *,
    what: str = "a whole number",
    unit: str = "",
) -> Callable[[str], int]:
    """An int; with ``unit="s"`` a trailing ``s`` is accepted too (``15s``)."""
    bounds = _bound_text(minimum, maximum, None)
    allowed = f"expected {what}" + (f" {bounds}" if bounds else "")

    def parse(text: str) -> int:
        raw = str(text).strip()
        if unit:
            raw = raw.removesuffix(unit)
        try:
            value = int(raw)
        except ValueError:
            raise Invalid(allowed) from None
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise Invalid(allowed)
        return value

    parse.__name__ = "integer"
    return _label(parse, "SECONDS" if unit == "s" else "N", allowed)


def number(
    minimum: float | None = None,
    maximum: float | None = None,
    *,
    above: float | None = None,
    unit: str = "",
    finite: bool = True,
) -> Callable[[str], float]:
    """A float; with ``unit="s"`` a trailing ``s`` is accepted too (``15s``)."""
    what = "a number of seconds" if unit == "s" else "a number"
    bounds = _bound_text(minimum, maximum, above)
    allowed = f"expected {what}" + (f" {bounds}" if bounds else "")

    def parse(text: str) -> float:
        raw = str(text).strip()
        if unit:
            raw = raw.removesuffix(unit)
        try:
            value = float(raw)
        except ValueError:
            raise Invalid(allowed) from None
        if (
            math.isnan(value)
            or (finite and math.isinf(value))
            or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)
            or (above is not None and value <= above)
        ):
            raise Invalid(allowed)
        return value

    parse.__name__ = "number"
    return _label(parse, "SECONDS" if unit == "s" else "NUM", allowed)


def seconds(minimum: float = 0, *, above: float | None = None) -> Callable[[str], float]:
    return number(minimum if above is None else None, above=above, unit="s")


def boolean(text: str) -> bool:
    word = str(text).strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise Invalid("expected true or false (also yes/no, on/off, 1/0)")


def memory(text: str) -> int:
    """Bytes, from a Kubernetes quantity (``4Gi`` is 4 * 2^30, ``4G`` is 4 * 10^9) or a byte
    count; a trailing ``B`` is accepted (``4GiB``, ``4GB``), nothing else is guessed."""
    from ladle.quantity import parse_quantity

    raw = str(text).strip()
    allowed = (
        "expected a size in bytes such as 4Gi or 4GiB (4 x 2^30), 4G or 4GB (4 x 10^9), "
        "512Mi or a plain byte count"
    )
    if raw[-2:] in ("iB", "kB") or (raw.endswith("B") and raw[-2:-1] in "MGTPE"):
        raw = raw[:-1]
    if raw.endswith("m") or raw[-1:] in ("n", "u"):
        # Kubernetes' milli (and smaller) suffixes: "512m" is half a byte, never 512 MiB.
        raise Invalid(f"{allowed} ('m' means milli in a quantity: write Mi or M)")
    try:
        value = parse_quantity(raw)
    except ValueError:
        raise Invalid(allowed) from None
    if value <= 0 or value != int(value):
        raise Invalid(f"{allowed}, positive and whole")
    return int(value)


def size_text(size: int) -> str:
    """Bytes as help shows them and ``memory`` reads them back (``8Mi``)."""
    for suffix, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if size and size % (1 << shift) == 0:
            return f"{size >> shift}{suffix}"
    return str(size)


def address(text: str) -> tuple[str, int]:
    host, sep, port = str(text).strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise Invalid("expected HOST:PORT, such as 127.0.0.1:8080")
    return host or "127.0.0.1", int(port)


def http_url(value: str) -> str:
    parts = urllib.parse.urlsplit(str(value).strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise Invalid("expected an http:// or https:// URL, such as http://otel-collector:4318")
    return parts.geturl()


def text(value: str) -> str:
    """A non-empty string (an empty variable is a mistake, not a value)."""
    if not str(value).strip():
        raise Invalid("must not be empty")
    return str(value).strip()


def existing_file(value: str) -> Path:
    path = Path(str(value)).expanduser()
    if not path.is_file():
        raise Invalid(f"no such file: {path}")
    return path


def existing_path(value: str) -> Path:
    path = Path(str(value)).expanduser()
    if not path.exists():
        raise Invalid(f"no such file or folder: {path}")
    return path


def yaml_problem(exc: Exception) -> str:
    """PyYAML's four-line error in one line: where the file broke and why."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(exc, "problem", None) or "invalid YAML"
    return f"not valid YAML{where}: {problem}"


_label(memory, "SIZE", "expected a size such as 4Gi, 4G or a plain byte count")
_label(address, "HOST:PORT", "expected HOST:PORT, such as 127.0.0.1:8080")


def log_level(value: str) -> str:
    word = str(value).strip().lower()
    if word not in LOG_LEVELS:
        raise Invalid(f"expected one of {', '.join(LOG_LEVELS)} (any case)")
    return word
