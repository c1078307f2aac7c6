from decimal import Decimal

import pytest

from ladle.quantity import parse_quantity, quantity_to_int


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("8", Decimal(8)),
        ("8Gi", Decimal(8 * 2**30)),
        ("1.5Gi", Decimal(3 * 2**29)),
        ("500m", Decimal("0.5")),
        ("2k", Decimal(2000)),
        ("1e3", Decimal(1000)),
        ("1E-3", Decimal("0.001")),
        ("4M", Decimal(4_000_000)),
        (".5", Decimal("0.5")),
        (3, Decimal(3)),
    ],
)
def test_parse_quantity(text: str | int, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "8 Gi", "8gi", "eight", "1.2.3", "8Gii"])
def test_parse_quantity_rejects_garbage(text: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(text)


def test_quantity_to_int_rounds_up_like_the_kubelet() -> None:
    assert quantity_to_int("1500m") == 2
    assert quantity_to_int("2") == 2
    assert quantity_to_int("4Gi") == 4 * 2**30
