"""Resource quantities are parsed exactly, with apimachinery's grammar and rounding."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest

from vkubelet.node.resolve import QuantityError, divide_ceil, parse_quantity

GI = 2**30


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", Fraction(0)),
        ("100m", Fraction(1, 10)),
        ("1", Fraction(1)),
        ("0.5", Fraction(1, 2)),
        (".5", Fraction(1, 2)),
        ("1.", Fraction(1)),
        ("+1k", Fraction(1000)),
        ("-1m", Fraction(-1, 1000)),
        ("1n", Fraction(1, 10**9)),
        ("250u", Fraction(1, 4000)),
        ("1M", Fraction(10**6)),
        ("1G", Fraction(10**9)),
        ("1T", Fraction(10**12)),
        ("1P", Fraction(10**15)),
        ("1E", Fraction(10**18)),
        ("1Ki", Fraction(1024)),
        ("12Mi", Fraction(12 * 2**20)),
        ("1Gi", Fraction(GI)),
        ("1.5Gi", Fraction(3 * GI, 2)),
        ("1Ti", Fraction(2**40)),
        ("1Pi", Fraction(2**50)),
        ("1e3", Fraction(1000)),
        ("1E3", Fraction(1000)),
        ("1e+3", Fraction(1000)),
        ("1e-3", Fraction(1, 1000)),
        ("2.5e2", Fraction(250)),
        ("007", Fraction(7)),
    ],
)
def test_quantity_strings_parse_to_their_exact_value(text: str, value: Fraction) -> None:
    assert parse_quantity(text).to_fraction() == value


@pytest.mark.parametrize(
    "text",
    ["", "1ki", "1K", "1e", "abc", "1.2.3", "1 Gi", "1Gib", "--1", "1e3.5", "1m5", "1Ee3"],
)
def test_malformed_quantities_are_rejected(text: str) -> None:
    with pytest.raises(QuantityError):
        parse_quantity(text)


@pytest.mark.parametrize("text", ["-", ".", "+", "Gi", "m"])
def test_apimachinery_scanner_quirk_reads_a_missing_number_as_zero(text: str) -> None:
    assert parse_quantity(text).is_zero


def test_json_numbers_are_quantities_too_but_booleans_are_not() -> None:
    assert parse_quantity(2).to_fraction() == 2
    assert parse_quantity(0.5).to_fraction() == Fraction(1, 2)
    with pytest.raises(QuantityError):
        parse_quantity(True)


def test_precision_finer_than_nano_rounds_away_from_zero() -> None:
    assert parse_quantity("0.1n").to_fraction() == Fraction(1, 10**9)
    assert parse_quantity("-0.1n").to_fraction() == Fraction(-1, 10**9)
    assert parse_quantity("1.0000000001").to_fraction() == Fraction(1_000_000_001, 10**9)
    assert parse_quantity("1e-999999999").to_fraction() == Fraction(1, 10**9)


def test_binary_quantities_are_capped_at_int64_like_apimachinery() -> None:
    assert parse_quantity("8Ei").to_fraction() == 2**63 - 1
    assert parse_quantity("7Ei").to_fraction() == 7 * 2**60


@pytest.mark.parametrize(
    ("quantity", "divisor", "expected"),
    [
        ("500m", "1m", 500),
        ("500m", "1", 1),
        ("1500m", "1", 2),
        ("2", "1m", 2000),
        ("64Mi", "1Mi", 64),
        ("64Mi", "1M", 68),
        ("100M", "1Mi", 96),
        ("1Gi", "1", GI),
        ("100u", "1m", 1),
        ("0", "1", 0),
        ("-1", "1", 0),
        ("1", "-1", 0),
    ],
)
def test_division_rounds_up_like_the_downward_api(
    quantity: str, divisor: str, expected: int
) -> None:
    assert divide_ceil(parse_quantity(quantity), parse_quantity(divisor)) == expected


def test_hostile_exponents_saturate_without_materialising_huge_numbers() -> None:
    start = time.monotonic()
    assert divide_ceil(parse_quantity("1e999999999"), parse_quantity("1")) == 2**63 - 1
    assert divide_ceil(parse_quantity("1"), parse_quantity("1e999999999")) == 1
    assert divide_ceil(parse_quantity("3e999999999"), parse_quantity("1e999999999")) == 3
    assert time.monotonic() - start < 1
    with pytest.raises(QuantityError):
        parse_quantity("1" * 5000)
