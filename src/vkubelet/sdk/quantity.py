"""Kubernetes resource quantities ("100m", "1Gi", "1e3"), parsed exactly as apimachinery does.

Providers read them from pod resources and node capacity; the agent needs them for the downward
API's `resourceFieldRef`. Exactness matters: a float would turn "0.1" CPU into 99m in places.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Final


class QuantityError(ValueError):
    """A string that is not a Kubernetes resource quantity."""


_DECIMAL_SUFFIXES: Final = {
    "n": -9,
    "u": -6,
    "m": -3,
    "": 0,
    "k": 3,
    "M": 6,
    "G": 9,
    "T": 12,
    "P": 15,
    "E": 18,
}
_BINARY_SUFFIXES: Final = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
# Same shape as apimachinery's scanner: sign, digits, optional fraction, then suffix letters,
# then an optional signed integer (only meaningful after "e"/"E"). Quirks kept on purpose:
# "1." and ".5" are numbers, and "-" or "." alone scan as zero.
_QUANTITY: Final = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?([eEinumkKMGTP]*[+-]?[0-9]*)")
_NANO_EXPONENT: Final = -9
_MAX_INT64: Final = 2**63 - 1
_MAX_EXPONENT: Final = 2**31 - 1  # apimachinery keeps scales in an int32
# Far beyond any real quantity, and below Python's int/str conversion limit.
_MAX_DIGITS: Final = 1000


@dataclass(frozen=True)
class Quantity:
    """An exact resource quantity: `coefficient * 10**exponent`.

    Kept as a decimal coefficient and exponent rather than a Fraction so that a hostile
    "1e999999999" costs nothing until it is compared against something of similar size.
    """

    coefficient: int
    exponent: int

    @property
    def sign(self) -> int:
        return (self.coefficient > 0) - (self.coefficient < 0)

    @property
    def is_zero(self) -> bool:
        return self.coefficient == 0

    def to_fraction(self) -> Fraction:
        """The exact value (beware: materialises 10**exponent)."""
        if self.exponent >= 0:
            return Fraction(self.coefficient * 10**self.exponent)
        return Fraction(self.coefficient, 10**-self.exponent)


ZERO: Final = Quantity(0, 0)


def parse_quantity(value: str | int | float) -> Quantity:
    """Parse a Kubernetes quantity ("100m", "1Gi", "1e3", "0.5", "+.5E-2", ...) exactly.

    Like apimachinery: values finer than a nano-unit are rounded away from zero to 1n, and binary
    (Ki..Ei) quantities are capped at 2**63-1 in magnitude. JSON numbers are accepted too, since
    the API accepts them as input.
    """
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise QuantityError(f"not a quantity: {value!r}")
    raw = value if isinstance(value, str) else str(value)
    match = _QUANTITY.fullmatch(raw)
    if not raw or match is None:
        raise QuantityError(f"quantities must match the Kubernetes grammar: {raw!r}")
    sign, whole, fraction, suffix = match.groups()
    fraction = fraction or ""
    if len(whole) + len(fraction) > _MAX_DIGITS:
        raise QuantityError(f"quantity has too many digits: {raw[:40]!r}...")
    coefficient = int(whole + fraction or "0")
    exponent = -len(fraction)
    binary = False
    if suffix in _DECIMAL_SUFFIXES:
        exponent += _DECIMAL_SUFFIXES[suffix]
    elif suffix in _BINARY_SUFFIXES:
        coefficient <<= _BINARY_SUFFIXES[suffix]
        binary = True
    elif len(suffix) > 1 and suffix[0] in "eE" and re.fullmatch(r"[+-]?[0-9]+", suffix[1:]):
        extra = int(suffix[1:])
        if abs(extra) > _MAX_EXPONENT:
            raise QuantityError(f"quantity exponent out of range: {raw!r}")
        exponent += extra
    else:
        raise QuantityError(f"unable to parse quantity's suffix: {raw!r}")
    coefficient, exponent = _round_up_to_nano(coefficient, exponent)
    # A binary quantity never has a positive exponent (only its fraction digits count).
    if binary and coefficient > _MAX_INT64 * 10**-exponent:
        coefficient, exponent = _MAX_INT64, 0
    return Quantity(-coefficient if sign == "-" else coefficient, exponent)


def _round_up_to_nano(coefficient: int, exponent: int) -> tuple[int, int]:
    """Round a non-negative value with precision finer than 1e-9 up to the next nano-unit."""
    if exponent >= _NANO_EXPONENT or coefficient == 0:
        return coefficient, exponent
    shift = _NANO_EXPONENT - exponent
    if len(str(coefficient)) <= shift:
        # Smaller than 1n (and shift may be astronomically large): the minimum is 1n.
        return 1, _NANO_EXPONENT
    quotient, remainder = divmod(coefficient, 10**shift)
    return quotient + (remainder != 0), _NANO_EXPONENT


def _magnitude(q: Quantity) -> int:
    """m such that 10**(m-1) <= |q| < 10**m, for non-zero q."""
    return len(str(abs(q.coefficient))) + q.exponent


def divide_ceil(quantity: Quantity, divisor: Quantity) -> int:
    """ceil(quantity / divisor), as the downward API reports resources.

    Non-positive values (or divisors) give 0 and ratios beyond int64 saturate, like the kubelet.
    """
    if quantity.sign <= 0 or divisor.sign <= 0:
        return 0
    spread = _magnitude(quantity) - _magnitude(divisor)
    if spread >= 20:  # the ratio exceeds 10**19 > 2**63-1
        return _MAX_INT64
    if spread <= -1:  # 0 < ratio < 1
        return 1
    numerator, denominator = quantity.coefficient, divisor.coefficient
    shift = quantity.exponent - divisor.exponent  # bounded by the digit counts here
    if shift >= 0:
        numerator *= 10**shift
    else:
        denominator *= 10**-shift
    return min(-(-numerator // denominator), _MAX_INT64)
