"""The calculator evaluates arithmetic exactly and refuses everything else, fast."""

import time

import pytest

from dora_jax.envs.calculator import CalculatorError, evaluate


@pytest.mark.parametrize("expression, expected", [
    ("37*41+12", "1529"),         # 1517 + 12
    ("2**10", "1024"),
    ("(3+4)*(5-2)", "21"),
    ("7/2", "3.5"),
    ("1/3", "0.333333"),          # never ends: rounded to 6 places
    ("2/3", "0.666667"),          # rounded half-even at the 6th place
    ("-1/3", "-0.333333"),
    ("1/8", "0.125"),             # finite expansion: exact, even past 6 places
    ("1/2**10", "0.0009765625"),
    ("0.1+0.2", "0.3"),           # literals are read as exact decimals
    ("1.5*2", "3"),
    ("7//2", "3"),
    ("-7//2", "-4"),
    ("-7%3", "2"),
    ("17 % 5", "2"),
    ("2**-2", "0.25"),
    ("-(2+3)", "-5"),
    ("+4", "4"),
    ("10**30", "1000000000000000000000000000000"),
    ("123456789*987654321", "121932631112635269"),
    ("10**30/7", "142857142857142857142857142857.142857"),
    ("  6 * 7 ", "42"),
    ("(" * 90 + "1" + ")" * 90, "1"),   # parentheses alone add no depth
    ("-" * 20 + "1", "1"),
])
def test_exact_results(expression, expected):
    assert evaluate(expression) == expected


@pytest.mark.parametrize("expression, reason", [
    ("__import__('os')", "Call is not allowed"),
    ("abs(-3)", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"),
    ("1 < 2", "Compare is not allowed"),
    ("[1, 2]", "List is not allowed"),
    ("lambda: 1", "Lambda is not allowed"),
    ("1 if 1 else 2", "IfExp is not allowed"),
    ("9**9**9", "exponent larger than 64"),
    ("2**65", "exponent larger than 64"),
    ("10**31", "exceeds 10**30"),
    ("99999999999**20", "exceeds 10**30"),
    ("(10**20)*(10**20)", "exceeds 10**30"),
    ("1e300", "exceeds 10**30"),
    ("2**0.5", "exponent must be an integer"),
    ("1/0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0**-1", "division by zero"),
    ("1 +", "not a valid expression"),
    ("1; 2", "not a valid expression"),
    ("", "empty expression"),
    ("   ", "empty expression"),
    ("1+" * 100 + "1", "longer than 200"),
    ("-" * 40 + "1", "nested too deeply"),
    ("-" * 150 + "1", "expression too large"),
    ("(" * 150 + "1" + ")" * 49, "not a valid expression"),
])
def test_refusals_are_fast_and_clear(expression, reason):
    start = time.monotonic()
    with pytest.raises(CalculatorError, match=reason.replace("*", r"\*")):
        evaluate(expression)
    assert time.monotonic() - start < 0.5


def test_error_is_a_value_error():
    assert issubclass(CalculatorError, ValueError)
    with pytest.raises(ValueError):
        evaluate(12)  # type: ignore[arg-type]
