"""An exact arithmetic calculator for model-written expressions.

The expression is parsed with ``ast`` (mode="eval") and walked over a whitelist:
int and float literals, ``+ - * / // % **``, unary ``+``/``-`` and parentheses.
Nothing is ever passed to ``eval``.  Arithmetic is exact: every value is a
``fractions.Fraction`` (float literals are read from their decimal text, so
``0.1`` is exactly one tenth).

Result text:
- an integer value is written exactly (``"1529"``);
- a non-integer whose decimal expansion is finite is written exactly (``"3.5"``);
- any other value is rounded half-to-even to 6 decimal places (``"0.333333"``)
  with trailing zeros removed.

Everything is bounded before it is computed, so a refusal is always fast:
expression length, AST depth and node count, exponent size and every
intermediate magnitude (numerator and denominator).
"""

from __future__ import annotations

import ast
import decimal
import fractions
import operator

MAX_CHARS = 200
MAX_DEPTH = 30
MAX_NODES = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
DECIMALS = 6


class CalculatorError(ValueError):
    """The expression is not allowed, malformed, or out of bounds."""


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _check(value: fractions.Fraction) -> fractions.Fraction:
    if abs(value.numerator) > MAX_MAGNITUDE or value.denominator > MAX_MAGNITUDE:
        raise CalculatorError("intermediate value exceeds 10**30")
    return value


def _literal(value: object) -> fractions.Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"only numbers are allowed, not {type(value).__name__}")
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise CalculatorError("number out of range")
        # repr is the shortest text that reads back as this float: 0.1 -> 1/10 exactly.
        return _check(fractions.Fraction(repr(value)))
    return _check(fractions.Fraction(value))


def _power(base: fractions.Fraction, exponent: fractions.Fraction) -> fractions.Fraction:
    if exponent.denominator != 1:
        raise CalculatorError("exponent must be an integer")
    e = exponent.numerator
    if abs(e) > MAX_EXPONENT:
        raise CalculatorError(f"exponent larger than {MAX_EXPONENT}")
    if e < 0 and base == 0:
        raise CalculatorError("division by zero")
    # Bound the result from the sizes of the parts before computing it.
    for part in (base.numerator, base.denominator):
        if abs(part) > 1 and (abs(part).bit_length() - 1) * abs(e) > 100:
            raise CalculatorError("power result exceeds 10**30")
    return _check(base**e)


def _walk(node: ast.AST, depth: int) -> fractions.Fraction:
    if depth > MAX_DEPTH:
        raise CalculatorError("expression nested too deeply")
    if isinstance(node, ast.Expression):
        return _walk(node.body, depth + 1)
    if isinstance(node, ast.Constant):
        return _literal(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _walk(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left = _walk(node.left, depth + 1)
        right = _walk(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not allowed")
        if right == 0 and op in (operator.truediv, operator.floordiv, operator.mod):
            raise CalculatorError("division by zero")
        return _check(fractions.Fraction(op(left, right)))
    raise CalculatorError(f"{type(node).__name__} is not allowed")


def _format(value: fractions.Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    for prime in (2, 5):
        while d % prime == 0:
            d //= prime
    with decimal.localcontext() as ctx:
        ctx.prec = 200  # a finite expansion of n/d within the bounds has < 140 digits
        exact = decimal.Decimal(value.numerator) / decimal.Decimal(value.denominator)
        if d != 1:  # the expansion never ends: round
            exact = exact.quantize(decimal.Decimal(1).scaleb(-DECIMALS),
                                   rounding=decimal.ROUND_HALF_EVEN)
        text = format(exact, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def evaluate(expression: str) -> str:
    """The exact value of an arithmetic ``expression`` as text.

    Raises ``CalculatorError`` for anything but numbers, ``+ - * / // % **``, unary
    signs and parentheses, and for any expression or value past the bounds above.
    """
    if not isinstance(expression, str):
        raise CalculatorError("expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculatorError(f"expression longer than {MAX_CHARS} characters")
    if not expression.strip():
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError) as exc:
        reason = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        raise CalculatorError(f"not a valid expression: {reason}") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError("expression too large")
    return _format(_walk(tree, 0))
