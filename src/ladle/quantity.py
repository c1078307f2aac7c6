"""Kubernetes resource quantities ("8Gi", "500m", "1e3") as exact numbers.

The CRD already rejects malformed quantities with CEL's ``isQuantity``; this parser exists
because the runtime takes ``--kv-cache-memory`` as a plain byte count and GPU capacity arrives
as a quantity string on Node objects.
"""

from __future__ import annotations

import functools
import re
from decimal import Decimal

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
}
_PATTERN = re.compile(
    r"^(?P<num>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<bin>Ki|Mi|Gi|Ti|Pi|Ei)|(?P<exp>[eE][+-]?\d+)|(?P<dec>[numkMGTPE]?))$"
)


@functools.lru_cache(maxsize=1024)
def parse_quantity(text: str | int | float) -> Decimal:
    """Return the exact value of a quantity; raise ValueError for anything else.

    Cached: pool status reads every node's GPU count on each reconcile, and they repeat."""
    if isinstance(text, int | float):
        return Decimal(str(text))
    match = _PATTERN.match(text.strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    number = Decimal(match["num"])
    if match["bin"]:
        return number * _BINARY[match["bin"]]
    if match["exp"]:
        return number * (Decimal(10) ** int(match["exp"][1:]))
    return number * _DECIMAL[match["dec"] or ""]


def quantity_to_int(text: str | int | float) -> int:
    """Round a quantity up to a whole number, as the kubelet does for integer resources."""
    value = parse_quantity(text)
    whole = int(value)
    return whole + 1 if value > whole else whole
