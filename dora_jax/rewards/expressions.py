"""Plain arithmetic expressions (integer literals, + - * /, unary minus, parentheses)
read with `ast` and evaluated exactly: nothing in the text is ever run. The countdown
verifier (verifiers.py) and reasoning_gym's countdown and puzzle24 scoring
(reasoning_gym_scores.py) share it; it imports nothing of the project."""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction
from typing import cast

_MAX_EXPR_CHARS = 1000
_MAX_DEPTH = 64
# Far beyond any value reachable from a handful of small numbers; a guard, not a limit
# a correct answer meets.
_MAX_MAGNITUDE = 10**100


class _Rejected(Exception):
    """The expression is not a plain arithmetic expression over the given numbers."""


def _literals(node: ast.AST, depth: int = 0) -> list[int]:
    """The integer literals of an arithmetic-only tree; _Rejected for anything else."""
    if depth > _MAX_DEPTH:
        raise _Rejected("too deeply nested")
    if isinstance(node, ast.Expression):
        return _literals(node.body, depth + 1)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        return _literals(node.left, depth + 1) + _literals(node.right, depth + 1)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return _literals(node.operand, depth + 1)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value > _MAX_MAGNITUDE:
            raise _Rejected("literal too large")
        return [node.value]
    raise _Rejected(f"not allowed: {type(node).__name__}")


def _evaluate(node: ast.AST) -> Fraction:
    """Exact value of a tree `_literals` accepted."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return Fraction(cast(int, node.value))  # `_literals` accepts int constants only
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand)
    assert isinstance(node, ast.BinOp)  # the one node left that `_literals` accepts
    left, right = _evaluate(node.left), _evaluate(node.right)
    if isinstance(node.op, ast.Add):
        value = left + right
    elif isinstance(node.op, ast.Sub):
        value = left - right
    elif isinstance(node.op, ast.Mult):
        value = left * right
    else:
        if right == 0:
            raise _Rejected("division by zero")
        value = left / right
    if abs(value.numerator) > _MAX_MAGNITUDE or value.denominator > _MAX_MAGNITUDE:
        raise _Rejected("intermediate value too large")
    return value


def _parse_arithmetic(expression: str) -> tuple[ast.AST, list[int]] | None:
    """(tree, integer literals) of a plain arithmetic expression, else None. `ast`
    only parses: nothing in the text is ever run."""
    expression = expression.strip()
    if not expression or len(expression) > _MAX_EXPR_CHARS:
        return None
    try:
        tree = ast.parse(expression, mode="eval")
        return tree, _literals(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError, _Rejected):
        return None


def literals_used(expression: str) -> list[int]:
    """The integer literals of a plain arithmetic expression ([] if it is not one)."""
    parsed = _parse_arithmetic(expression)
    return [] if parsed is None else parsed[1]


def safe_arithmetic(expression: str, numbers: Sequence[int]) -> Fraction | None:
    """The exact value of `expression` if it is built only from integer literals,
    + - * /, unary minus and parentheses, uses each literal at most as often as it
    appears in `numbers`, and divides by no zero; else None. Never executes code."""
    parsed = _parse_arithmetic(expression)
    if parsed is None:
        return None
    tree, used = parsed
    if Counter(used) - Counter(int(n) for n in numbers):
        return None
    try:
        return _evaluate(tree)
    except (_Rejected, RecursionError):
        return None
